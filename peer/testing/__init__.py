"""Real daemons as processes, for tests, benchmarks and `peer local` (in the manner of `trio.testing`:
helpers shipped with the library). Network namespaces for multi-host setups live in `netns.py`."""

CHECKS = ("check_swarm", "check_pair", "check_closable")  # peer/testing/conformance.py: what every Swarm promises


def __getattr__(name: str):
    """`peer.testing.check_swarm` and its kin, loaded on first use: the other helpers here need no torch."""
    if name in CHECKS:
        from peer.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'peer.testing' has no attribute {name!r}")
