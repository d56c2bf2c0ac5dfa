"""Arguments several `peer` commands share (the home, config overrides) and the config they make.

`main.py` builds the parser and the commands; `doctor.py` is one of them; both read their common arguments
here, so neither imports the other's helpers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peer.config import Config


def home_of(args: argparse.Namespace) -> Path:
    """The home a command acts on: --home, else $PEERTRAIN_HOME or ~/.peertrain."""
    from peer.home import default_home

    return Path(args.home).expanduser() if getattr(args, "home", None) else default_home()


def add_home(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", metavar="DIR", help="daemon home directory (default: $PEERTRAIN_HOME or ~/.peertrain)")


def add_config_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/ and `peer config docs`)")
    p.add_argument("--listen", metavar="HOST:PORT", help="address to accept peers on; port 0 picks a free one")
    p.add_argument("--join", metavar="HOST:PORT", action="append", default=[], help="bootstrap peer to dial (repeatable)")
    p.add_argument("--swarm", metavar="NAME", help="swarm name; only daemons of the same swarm connect")
    p.add_argument("--no-mdns", action="store_true", help="do not announce or browse with mDNS")
    p.add_argument("--log-format", choices=["text", "json"], help="log line format")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity")


def effective_config(args: argparse.Namespace) -> Config:
    """Defaults < config file < command-line flags."""
    from peer import config as c

    cfg = c.load(args.config)
    daemon: dict = {}
    if args.listen:
        daemon["listen"] = args.listen
    if args.join:
        daemon["join"] = list(cfg.daemon.join) + list(args.join)
    if args.swarm:
        daemon["swarm"] = args.swarm
    if args.log_format:
        daemon["log_format"] = args.log_format
    if args.log_level:
        daemon["log_level"] = args.log_level
    changes: dict = {}
    if daemon:
        changes["daemon"] = daemon
    if args.no_mdns:
        changes["discovery"] = {"mdns": False}
    return cfg.replace(**changes) if changes else cfg
