"""peertrain's daemon, one folder per concern (read top-down):

- `daemon.py` owns the trio nursery and wires the services; `home.py` (every file name in a home
  directory), `control.py` (the control socket), `services.py` (the Service protocol and the registry).
- `config/`      the configuration: typed sections read from TOML, checked, written back, documented.
- `session/`     authenticated encrypted sessions over TCP: messages, tensors and tensor groups.
- `membership/`  who is in the swarm: one session per peer, heartbeats, peer records, mDNS discovery.
- `topology/`    the gossip graph: records, mixing weights, spectral gap, rewiring, graph yardsticks.
- `averaging/`   the sum-preserving pairwise exchange of a trainer's tensors with neighbours.
- `trainer_host.py` runs the configured trainer and hands it `TrainerSwarm`, the hosted implementation of
  the `Swarm` protocol (peertrain/swarm.py); `training_report.py` is what a job shows `peer status`.
- `cli/`         the `peer` command and its views; `testing/` real daemons for tests, benches and
  `peer local`; `bench/` the `peer bench ...` measurements.
"""

__version__ = "0.1.0"
