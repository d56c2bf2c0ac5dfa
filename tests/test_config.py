"""Config validation: what a user may write in [security] ciphers, and the error for what they may not."""

from __future__ import annotations

import re

import pytest

from peer.config import ConfigError, from_mapping, validate_semantics
from protocol.cipher import CIPHERS


@pytest.mark.parametrize("ciphers", [["auto"], list(CIPHERS), [CIPHERS[-1], CIPHERS[0]]])
def test_every_negotiable_cipher_and_auto_are_accepted(ciphers: list[str]) -> None:
    validate_semantics(from_mapping({"security": {"ciphers": ciphers}}))


def test_unknown_cipher_names_the_choices() -> None:
    expected = f"unknown cipher 'aes-128-cbc' (use {', '.join(CIPHERS)} or auto)"
    with pytest.raises(ConfigError, match=re.escape(expected)) as err:
        validate_semantics(from_mapping({"security": {"ciphers": ["aes-128-cbc"]}}))
    assert "[security] ciphers" in str(err.value)


def test_rewiring_confidence_reaches_the_planner_and_is_range_checked() -> None:
    from types import SimpleNamespace

    from peer.topology.service import TopologyService

    cfg = from_mapping({"topology": {"confidence": 2.5}})
    validate_semantics(cfg)
    service = SimpleNamespace(shard_bytes=1 << 20, cfg=cfg.topology)
    assert TopologyService.rewire_config(service).confidence == 2.5
    with pytest.raises(ConfigError, match=re.escape("[topology] confidence: expected 0 to 10 standard errors, got -1.0")):
        validate_semantics(from_mapping({"topology": {"confidence": -1.0}}))
