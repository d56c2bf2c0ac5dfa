"""`peer doctor` and the dial-error explanations it shows: every kind of failed dial, with real handshake
errors from two sans-I/O handshakes; checks from made-up daemon statuses; the command end to end."""

from __future__ import annotations

import errno
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from peer.bench.hosts import free_port
from peer.cli.doctor import Probe, bootstrap_check, key_fingerprint
from peer.cli.doctor_status import Check, checks_from_status, clock_check
from peer.cli.main import main
from peer.nat.explain import DialProblem, explain_dial_error
from peer.testing.swarm import swarm_config, unique_swarm, write_config
from protocol import PROTOCOL_VERSION
from protocol.cipher import CIPHERS
from protocol.errors import HandshakeError
from protocol.frames import encode_length_prefixed
from protocol.handshake import Handshake, prologue_for
from protocol.identity import generate_identity, peer_id_of
from protocol.noise import AUTHENTICATION_FAILED, NoiseXXState
from peer.testing.pace import scaled

REPO = Path(__file__).resolve().parent.parent
HOST, PORT = "198.51.100.7", 7100
WHERE = f"{HOST}:{PORT}"


def explain(exc: BaseException) -> DialProblem:
    problem = explain_dial_error(exc, HOST, PORT, timeout=5.0)
    assert WHERE in problem.cause and "\n" not in problem.cause + problem.fix and problem.fix
    return problem


# ---- real handshake errors (sans-I/O: two Handshake objects, bytes carried by hand) ----------------

INITIATOR, RESPONDER = generate_identity(), generate_identity()


def handshake_error(init: dict | None = None, resp: dict | None = None) -> HandshakeError:
    """The error either side raises when handshakes with these settings meet."""
    i = Handshake(initiator=True, identity=INITIATOR, **{"swarm": "lab", **(init or {})})
    r = Handshake(initiator=False, identity=RESPONDER, **{"swarm": "lab", **(resp or {})})
    message = i.data_to_send()
    with pytest.raises(HandshakeError) as info:
        for step in range(3):
            side = r if step % 2 == 0 else i
            side.receive_data(message)
            message = side.data_to_send()
    return info.value


def test_dns_failure():
    p = explain(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert "cannot resolve" in p.cause and "DNS" in p.fix


def test_connection_refused_also_inside_trios_all_attempts_failed():
    assert "refused" in explain(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")).cause
    try:  # trio's own wrapping: an OSError without errno, the per-address errors in its __cause__
        raise OSError("all attempts to connect failed") from ExceptionGroup("all", [
            OSError(errno.ENETUNREACH, "Network is unreachable"),
            ConnectionRefusedError(errno.ECONNREFUSED, "refused")])
    except OSError as exc:
        p = explain(exc)
    assert "refused the connection" in p.cause and "peer start" in p.fix and "[daemon] listen" in p.fix


@pytest.mark.parametrize("exc", [trio.TooSlowError(), TimeoutError(), OSError(errno.ETIMEDOUT, "timed out")])
def test_timeout(exc):
    p = explain(exc)
    assert "no answer" in p.cause and "5 s" in p.cause and f"open TCP {PORT}" in p.fix and "router" in p.fix


def test_unreachable_network_and_host():
    assert "network unreachable" in explain(OSError(errno.ENETUNREACH, "Network is unreachable")).cause
    p = explain(OSError(errno.EHOSTUNREACH, "No route to host"))
    assert "no route to host" in p.cause and f"open TCP {PORT}" in p.fix


@pytest.mark.parametrize("exc", [ConnectionResetError(errno.ECONNRESET, "reset"), trio.BrokenResourceError(),
                                 HandshakeError("connection closed during the handshake")])
def test_closed_or_reset_during_the_handshake_points_at_the_swarm_key_first(exc):
    p = explain(exc)
    assert "hung up during the handshake" in p.cause and "swarm key" in p.cause
    assert "swarm_key_file" in p.fix and "[daemon] swarm" in p.fix


def test_closed_is_what_a_dialer_with_another_swarm_key_sees():
    # the responder cannot read message 1 and hangs up; the dialer's handshake reads EOF
    err = handshake_error({"psk": b"key one"}, {"psk": b"key two"})
    assert "swarm key" in explain(err).cause  # the responder's own error, for daemons that report it
    dialer = Handshake(initiator=True, identity=INITIATOR, swarm="lab", psk=b"key one")
    with pytest.raises(HandshakeError) as info:
        dialer.receive_data(b"")
    assert "hung up" in explain(info.value).cause


def test_other_swarm_name():
    p = explain(handshake_error({"swarm": "alpha"}, {"swarm": "beta"}))
    assert "swarm name" in p.cause and "[daemon] swarm" in p.fix


def test_only_one_side_has_a_swarm_key():
    p = explain(handshake_error({"psk": b"secret"}, {}))
    assert "only one side uses a swarm key" in p.cause and "swarm_key_file" in p.fix


def test_protocol_version():
    future = NoiseXXState(initiator=True, prologue=prologue_for("lab"), static=X25519PrivateKey.generate())
    hello = msgpack.packb({"v": PROTOCOL_VERSION + 1, "ciphers": list(CIPHERS)})
    resp = Handshake(initiator=False, identity=RESPONDER, swarm="lab")
    with pytest.raises(HandshakeError) as info:
        resp.receive_data(encode_length_prefixed(future.write_message(hello)))
    p = explain(info.value)
    assert f"protocol version {PROTOCOL_VERSION + 1}" in p.cause and "peer --version" in p.fix


def test_not_on_the_allow_list():
    p = explain(handshake_error({}, {"allowed_peer_ids": frozenset({peer_id_of(RESPONDER)})}))
    assert peer_id_of(INITIATOR) in p.cause and "allow_peers" in p.cause and peer_id_of(INITIATOR) in p.fix


def test_unexpected_peer_id():
    other = peer_id_of(generate_identity())
    p = explain(handshake_error({"expected_peer_id": other}, {}))
    assert f"is now peer {peer_id_of(RESPONDER)}, not {other}" in p.cause and "another daemon" in p.cause


def test_no_common_cipher():
    p = explain(handshake_error({"ciphers": ["chacha20-poly1305"]}, {"ciphers": ["aes-256-gcm"]}))
    assert "no cipher in common" in p.cause and "[security] ciphers" in p.fix


def test_every_handshake_error_message_has_its_own_explanation():
    """Each message protocol/handshake.py and protocol/noise.py can raise (read from their source, so a new
    one without an explanation fails here) gets a specific cause, not the catch-all."""
    messages = []
    for name in ("handshake.py", "noise.py"):
        source = (REPO / "protocol" / name).read_text()
        messages += [re.sub(r"\{[^}]*\}", "x", m) for m in re.findall(r'HandshakeError\(\s*f?"([^"]+)"', source)
                     if not m.startswith("handshake already failed")]  # a wrapper of the first error: below
    messages += [AUTHENTICATION_FAILED, "handshake already failed: " + AUTHENTICATION_FAILED]
    assert len(messages) > 15
    for msg in messages:
        assert not explain(HandshakeError(msg)).cause.startswith("handshake with"), msg


def test_another_service_answering():
    p = explain(HandshakeError(f"handshake message of {int.from_bytes(b'HTTP', 'big')} bytes exceeds the limit"))
    assert "does not speak the peertrain handshake" in p.cause and "'HTTP'" in p.cause


def test_anything_else_names_its_type():
    p = explain(RuntimeError("boom"))
    assert "RuntimeError: boom" in p.cause


# ---- checks from a daemon's status ----------------------------------------------------------------

def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def status(**nat) -> dict:
    return {"listen": "0.0.0.0:7100", "connected": 1, "peers": [], "nat": nat}


def test_public_needs_no_relay():
    c = by_name(checks_from_status(status(reachability="public", reason="2 of 2 peers dialed back",
                                          evidence=[{"address": "203.0.113.5:7100", "ok": True}],
                                          nat_mapping="none", relay_server={"offering": True, "reservations": 3})))
    assert c["reachability"].status == "ok" and "203.0.113.5:7100" in c["reachability"].finding
    assert c["relays"].status == "ok" and "not needed" in c["relays"].finding and "3 peers" in c["relays"].finding
    assert c["NAT mapping"].status == "ok"


def test_behind_nat_without_a_relay_fails():
    c = by_name(checks_from_status(status(reachability="nat", reason="2 of 2 peers could not dial 10.99.0.1:7100",
                                          relays=[])))
    assert c["reachability"].status == "warn" and "10.99.0.1" in c["reachability"].finding
    assert "forward TCP 7100" in c["reachability"].fix and "relays" in c["reachability"].fix
    assert c["relays"].status == "fail" and "no relay accepted us" in c["relays"].finding
    assert "[relay] enabled = true" in c["relays"].finding


def test_behind_nat_with_relays():
    c = by_name(checks_from_status(status(reachability="nat", relays=[
        {"peer_id": peer_id_of(RESPONDER), "address": "203.0.113.9:7100", "since_s": 12.0}])))
    assert c["relays"].status == "ok" and "203.0.113.9:7100" in c["relays"].finding


def test_unknown_reachability_and_random_mapping():
    c = by_name(checks_from_status(status(reachability="unknown", nat_mapping="random",
                                          punches={"attempts": 4, "succeeded": 0, "failed": 4})))
    assert c["reachability"].status == "warn" and "at least 2 peers" in c["reachability"].finding
    assert c["NAT mapping"].status == "warn" and "hole punching cannot work" in c["NAT mapping"].finding
    assert "0 of 4" in c["NAT mapping"].finding and c["relays"].status == "skip"


def test_the_daemons_failing_bootstrap_peers():
    st = {"connected": 0, "bootstrap": [
        {"address": "203.0.113.1:7100", "peer_id": None, "state": "failing", "failures": 3,
         "cause": "203.0.113.1:7100 refused the connection", "fix": "is `peer start` running?"},
        {"address": "203.0.113.2:7100", "peer_id": "x", "state": "connected", "failures": 0, "cause": "", "fix": ""}]}
    c = by_name(checks_from_status(st))
    failing = c["bootstrap 203.0.113.1:7100 (daemon)"]
    assert failing.status == "fail" and "refused" in failing.finding and failing.fix == "is `peer start` running?"
    assert "bootstrap 203.0.113.2:7100 (daemon)" not in c
    assert by_name(checks_from_status({**st, "connected": 2}))["bootstrap 203.0.113.1:7100 (daemon)"].status == "warn"


@pytest.mark.parametrize("offset, verdict", [(3.0, "ok"), (-120.0, "warn"), (400.0, "fail")])
def test_clock(offset, verdict):
    st = {"peers": [{"peer_id": peer_id_of(RESPONDER), "clock_offset_s": 1.0},
                    {"peer_id": peer_id_of(INITIATOR), "clock_offset_s": None}]}
    c = by_name(checks_from_status(st, probe_offsets=[("203.0.113.1:7100", offset)]))["clock"]
    assert c.status == verdict and f"{offset:+.1f}" in c.finding
    assert verdict == "ok" or "timedatectl set-ntp true" in c.fix
    assert clock_check([]).status == "skip"


@pytest.mark.parametrize("st", [{}, {"nat": "garbage", "peers": None, "bootstrap": "x"},
                                {"nat": {"evidence": [None], "relays": [1], "punches": []}, "peers": [None]}])
def test_a_status_lacking_sections_skips_never_raises(st):
    checks = checks_from_status(st)
    assert {c.name for c in checks} >= {"reachability", "NAT mapping", "relays", "clock"}
    assert all(c.status in ("skip", "ok", "warn") for c in checks)


def test_bootstrap_verdicts():
    pid = peer_id_of(RESPONDER)
    assert bootstrap_check(Probe("h:1", pid, 0.012, 2.5)).finding.endswith("12 ms, clock +2.5 s")
    assert bootstrap_check(Probe("h:1", pid, 0.01), allow_peers=[peer_id_of(INITIATOR)]).status == "fail"
    refused = Probe("h:1", problem=DialProblem("h:1 is peer x, not on the allow-list", "add it"), allow_list=True)
    assert bootstrap_check(refused).status == "warn"
    assert len(key_fingerprint(b"k" * 32)) == 8


# ---- the command end to end -------------------------------------------------------------------------

def doctor(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["doctor", "--json", "--timeout", "3", *args])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.process
def test_nothing_listening_at_the_bootstrap_address(tmp_path):
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "peer", "doctor", "--home", str(tmp_path / "home"), "--listen",
                        "127.0.0.1:0", "--join", f"127.0.0.1:{port}", "--json"], capture_output=True, text=True,
                       cwd=REPO, timeout=scaled(60))
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is False
    boot = next(c for c in out["checks"] if c["name"] == f"bootstrap 127.0.0.1:{port}")
    assert boot["status"] == "fail" and "refused" in boot["finding"] and "peer start" in boot["fix"]
    statuses = {c["name"]: c["status"] for c in out["checks"]}
    assert statuses["config"] == statuses["home"] == statuses["listen"] == "ok" and statuses["daemon"] == "skip"


@pytest.mark.slow
def test_a_running_daemon_as_bootstrap_with_the_right_and_a_wrong_swarm_key(cluster, tmp_path, capsys):
    (tmp_path / "swarm.key").write_text("the right key, 32 bytes or so..\n")
    (tmp_path / "other.key").write_text("another key, just as long.......\n")
    cfg = swarm_config(swarm=unique_swarm(), mdns=False).replace(security={"swarm_key_file": "swarm.key"})
    a = cluster.start("a", config=write_config(tmp_path / "a.toml", cfg))
    a_addr = a.wait_ready()["listen"]
    home = str(tmp_path / "doctor-home")

    rc, out = doctor(capsys, "--home", home, "--config", str(tmp_path / "a.toml"), "--join", a_addr)
    checks = by_name([Check(**c) for c in out["checks"]])
    assert rc == 0 and out["ok"], out
    assert checks[f"bootstrap {a_addr}"].status == "ok" and "handshake in" in checks[f"bootstrap {a_addr}"].finding
    assert checks["swarm key"].finding.endswith(key_fingerprint(b"the right key, 32 bytes or so.."))

    write_config(tmp_path / "wrong.toml", cfg.replace(security={"swarm_key_file": "other.key"}))
    rc, out = doctor(capsys, "--home", home, "--config", str(tmp_path / "wrong.toml"), "--join", a_addr)
    boot = by_name([Check(**c) for c in out["checks"]])[f"bootstrap {a_addr}"]
    assert rc == 1 and not out["ok"] and boot.status == "fail" and "swarm key" in boot.finding

    # doctor on the daemon's own home: it is found running, and its status is read (no reachability
    # section in this version: those checks are skipped)
    rc, out = doctor(capsys, "--home", str(a.home), "--config", str(tmp_path / "a.toml"))
    checks = by_name([Check(**c) for c in out["checks"]])
    assert checks["daemon"].status == "ok" and a_addr in checks["listen"].finding
    assert checks["reachability"].status in ("skip", "ok", "warn")

    assert main(["doctor", "--home", home, "--config", str(tmp_path / "wrong.toml"), "--join", a_addr]) == 1
    table = capsys.readouterr().out
    assert "✘" in table and "[security] swarm_key_file" in table and "1 check failed" in table
