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


# ---- ranges, declared once with each key (issue 15, class 8) ---------------------------------------

import dataclasses
import math
import tomllib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.config import Config, Range, docs_markdown, load
from peer.config.rendering import _toml_value
from protocol import identity as ident


def _ranged_keys() -> list[tuple[str, str, Range, type]]:
    out = []
    for sec in dataclasses.fields(Config):
        if sec.name == "source":
            continue
        cls = sec.default_factory
        for f in dataclasses.fields(cls):
            if "range" in f.metadata:
                out.append((sec.name, f.name, f.metadata["range"], type(getattr(cls(), f.name))))
    return out


RANGED = _ranged_keys()


def _bad_values(rng: Range, tp: type) -> list:
    if tp is int:
        return [int(rng.lo) - 1, int(rng.hi) + 1, 2**63 - 1, -(2**63)]
    return [math.nan, math.inf, -math.inf, rng.lo if rng.lo_open else rng.lo - 1e-3,
            rng.hi if rng.hi_open else rng.hi * 2 + 1, -1e308, 1e308]


def test_every_numeric_key_declares_a_range_its_default_is_in_and_the_table_shows() -> None:
    for sec in dataclasses.fields(Config):
        if sec.name in ("source", "trainer"):
            continue
        for f in dataclasses.fields(sec.default_factory):
            if isinstance(getattr(sec.default_factory(), f.name), (int, float)) and not isinstance(
                    getattr(sec.default_factory(), f.name), bool):
                assert "range" in f.metadata, f"[{sec.name}] {f.name} has no range"
    table = docs_markdown()
    for section, key, rng, _ in RANGED:
        assert rng.contains(getattr(getattr(Config(), section), key)), (section, key)
        assert f"| `{section}.{key}` | " in table and f" | {rng.describe()} | " in table


@pytest.mark.parametrize("section,key,rng,tp", RANGED, ids=[f"{s}.{k}" for s, k, _, _ in RANGED])
def test_out_of_range_nan_and_infinite_values_fail_at_load_with_file_line_and_key(tmp_path, section, key, rng, tp):
    for bad in _bad_values(rng, tp):
        path = tmp_path / "c.toml"
        path.write_text(f"# a comment\n[{section}]\n{key} = {_toml_value(bad)}\n")
        with pytest.raises(ConfigError) as err:
            load(path)
        assert str(err.value).startswith(f"{path}:3: [{section}] {key}: expected "), str(err.value)


@pytest.mark.parametrize("text,where", [
    ("[limits]\nmax_frame_kib = 4194304\n", ":2: [limits] max_frame_kib: expected 64 to 4194303"),  # 4 GiB
    ("[limits]\nmax_frame_kib = 64\nmax_message_kib = 128\n", ":3: [limits] max_message_kib: a message must fit"),
    ("[limits]\nmax_tensor_mib = 9\nmax_inflight_tensor_mib = 8\n", ":2: [limits] max_tensor_mib: must fit"),
    ("[limits]\nmax_frame_kib = 64\nmax_message_kib = 16\n[gossip]\nchunk_kib = 1024\n", ":5: [gossip] chunk_kib: a chunk is one frame"),
    ("[membership]\nreconnect_min = 5.0\nreconnect_max = 1.0\n", ":3: [membership] reconnect_max: must be at least"),
    ("[membership]\nheartbeat_interval = 2.0\ndead_after = 2.0\n", ":3: [membership] dead_after: must exceed"),
    ('[membership]\nviews = "partial"\n[topology]\nkind = "ring"\n', ":4: [topology] kind: 'ring' lays its graph"),
    ("[membership]\ngap_round = 1.0\ngap_every = 30.0\n", ":3: [membership] gap_every: an estimate takes 60 rounds"),
    ("[membership]\nhandshake_timeout = inf\n", ":2: [membership] handshake_timeout: expected 0.1 to 120 s, got inf"),
    ("[membership]\ndead_after = 1e400\n", ":2: [membership] dead_after: expected"),  # TOML reads inf
    ("[membership]\ndead_after = 100000000000000000000000000000\n", ":2: [membership] dead_after: expected"),
    ('[metrics]\nlisten = "9100"\n', ":2: [metrics] listen: expected HOST:PORT, got '9100'"),
    ('[metrics]\nlisten = "127.0.0.1:65536"\n', ":2: [metrics] listen: port 65536 out of range 0..65535"),
    ('[daemon]\nlisten = "0.0.0.0:7100"\n[metrics]\nlisten = "127.0.0.1:7100"\n', ":4: [metrics] listen: port 7100 is"),
])
def test_cross_key_rules_and_the_frame_cap_name_file_line_and_key(tmp_path, text, where) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}{where}"), str(err.value)


@pytest.mark.parametrize("listen", ["", "127.0.0.1:9100", "127.0.0.1:0", "[::1]:9100", "0.0.0.0:9100"])
def test_metrics_listen_is_off_by_default_and_takes_host_port_with_port_0(listen) -> None:
    assert Config().metrics.listen == ""  # no [metrics] section: no HTTP server
    cfg = from_mapping({"daemon": {"listen": "127.0.0.1:0"}, "metrics": {"listen": listen}})
    assert cfg.metrics.listen == listen


def test_allow_peers_entries_must_be_peer_ids(tmp_path) -> None:
    good = ident.peer_id_of(ident.generate_identity())
    assert from_mapping({"security": {"allow_peers": [good]}}).security.allow_peers == [good]
    for bad in [good.upper(), good[:-1], good + "a", "12345678901234567890", "", " " + good[1:]]:
        path = tmp_path / "c.toml"
        path.write_text(f'[security]\nallow_peers = ["{good}", {_toml_value(bad)}]\n')
        with pytest.raises(ConfigError) as err:
            load(path)
        assert str(err.value).startswith(f"{path}:2: [security] allow_peers: {bad!r} is not a peer ID"), str(err.value)


# ---- the loader never fails any other way (hypothesis) -----------------------------------------------

_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.0, -0.0, 1e-300, 2**31, 2**32, 2**63 - 1, 4194303, 4194304]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30),
    st.booleans(),
)
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=4),
                    st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), _SCALARS, max_size=3))
_SECTIONS = {s.name: [f.name for f in dataclasses.fields(s.default_factory)]
             for s in dataclasses.fields(Config) if s.name != "source"}


@st.composite
def _config_mappings(draw) -> dict:
    data = {}
    for section in draw(st.lists(st.sampled_from([*_SECTIONS, "bogus"]), unique=True, max_size=4)):
        keys = draw(st.lists(st.sampled_from([*_SECTIONS.get(section, []), "bogus_key"]), unique=True, max_size=6))
        data[section] = {k: draw(_VALUES) for k in keys}
    return data


def _to_toml(data: dict) -> str:
    return "".join(f"[{s}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in kv.items()) for s, kv in data.items())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_config_mappings())
def test_loader_returns_a_valid_config_or_a_config_error_naming_the_key(data) -> None:
    text = _to_toml(data)
    parsed = tomllib.loads(text)
    try:
        cfg = from_mapping(parsed, path="c.toml", text=text)
    except ConfigError as exc:
        m = re.match(r"c\.toml(?::\d+)?: \[(\w+)\](?: (\w+))?:", str(exc))
        assert m, str(exc)
        section, key = m.groups()
        assert section in data or section in _SECTIONS, str(exc)
        assert key is None or key in _SECTIONS.get(section, []) or key in data.get(section, {}), str(exc)
        return
    validate_semantics(cfg)  # what was accepted passes every range
    for section, key, rng, tp in RANGED:
        v = getattr(getattr(cfg, section), key)
        assert type(v) is tp and rng.contains(v)
