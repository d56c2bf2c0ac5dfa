"""Averaging: symmetric pairwise exchanges of a trainer's tensors with gossip neighbours that keep the
swarm-wide sum exact (docs/design.md, "The averaging exchange")."""
