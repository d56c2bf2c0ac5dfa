"""Daemon configuration: typed sections loaded from TOML, validated with errors that name file, line and key.

Precedence is defaults < config file < command-line flags. Every field carries a one-line doc in its
metadata; `peer config docs` prints them, and docs/config.md's reference is generated from them
so the docs cannot drift from the code.

The package is the interface (`from peer.config import Config, load`). Inside it: how a key is declared
(keys.py), the sections and `Config` (sections.py), the rules a config must meet (checks.py), reading
one from TOML (loading.py), and writing it out and its reference (rendering.py).
"""

from peer.config.checks import parse_hostport, validate_semantics
from peer.config.keys import ConfigError, Range
from peer.config.loading import from_mapping, load
from peer.config.rendering import docs_markdown, to_toml
from peer.config.sections import (
    AttachSection, Config, DaemonSection, DashboardSection, DiscoverySection, GossipSection, LimitsSection, MembershipSection,
    MetricsSection, NatSection, PipelineSection, RelaySection, SecuritySection, TopologySection, TrainerSection)

__all__ = [
    "AttachSection", "Config", "ConfigError", "DaemonSection", "DashboardSection", "DiscoverySection", "GossipSection", "LimitsSection",
    "MembershipSection", "MetricsSection", "NatSection", "PipelineSection", "Range", "RelaySection",
    "SecuritySection", "TopologySection", "TrainerSection", "docs_markdown", "from_mapping", "load", "parse_hostport",
    "to_toml", "validate_semantics",
]
