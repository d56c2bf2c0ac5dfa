"""Real daemons as processes, for tests, benchmarks and `peer local` (in the manner of `trio.testing`:
helpers shipped with the library). Network namespaces for multi-host setups live in `netns.py`."""
