"""peertrain's daemon: transport, discovery, membership, topology, gossip, control socket and CLI."""

__version__ = "0.1.0"
