"""The home directory is the daemon's own: refused when another user owns it or others can write it (they
could plant an identity key or a checkpoint), claimed by one daemon before the identity key exists, and the
key is created once even when two processes race for it (issue 15, class 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from peer.home import Home, HomeError, create_exclusive
from peer.testing.daemon import DaemonProcess
from peer.testing.process import wait_for
from protocol import identity as ident
from tests.daemons import REPO, config_file, unique_swarm
from peer.testing.pace import scaled


def _peer_id(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer", "id", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=scaled(60))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_home_owned_by_another_user_is_refused(tmp_path) -> None:
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    os.chown(home, 65534, 65534)
    with pytest.raises(HomeError, match=r"owned by uid 65534, not by this user .*`chown 0 "):
        Home(home).load_or_create_identity()
    r = _peer_id("--home", str(home))
    assert r.returncode == 2 and "owned by uid 65534" in r.stderr, r.stderr
    assert not Home(home).identity_file.exists()


@pytest.mark.parametrize("mode,who", [(0o777, "group"), (0o770, "group"), (0o702, "others"), (0o1777, "group")])
def test_a_home_others_can_write_is_refused_with_the_fix(tmp_path, mode, who) -> None:
    home = tmp_path / "h"
    home.mkdir()
    os.chmod(home, mode)
    with pytest.raises(HomeError, match=rf"writable by {who} .*`chmod 700 {home}`"):
        Home(home).ensure()
    r = _peer_id("--home", str(home))
    assert r.returncode == 2 and "chmod 700" in r.stderr, r.stderr
    assert not Home(home).identity_file.exists()
    os.chmod(home, 0o700)  # the fix the message gives works
    assert _peer_id("--home", str(home)).returncode == 0


def test_a_new_home_is_private_and_a_read_only_group_is_fine(tmp_path) -> None:
    home = Home(tmp_path / "new" / "h").ensure()
    assert os.stat(home.root).st_mode & 0o777 == 0o700
    os.chmod(home.root, 0o750)
    Home(home.root).ensure()


def test_one_claim_per_home_released_with_its_holder(tmp_path) -> None:
    home = Home(tmp_path / "h")
    first = home.claim()
    with pytest.raises(HomeError, match="already running with this home"):
        home.claim()
    first.release()
    home.claim().release()


def test_create_exclusive_keeps_the_first_file(tmp_path) -> None:
    path = tmp_path / "k"
    assert create_exclusive(path, b"first")
    assert not create_exclusive(path, b"second")
    assert path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["k"]  # no temp file left behind


def test_racing_threads_all_get_the_one_identity(tmp_path) -> None:
    home = Home(tmp_path / "h")
    start, ids, errors = threading.Barrier(16), [], []

    def go() -> None:
        start.wait()
        try:
            ids.append(ident.peer_id_of(home.load_or_create_identity()))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(ids) == 16 and len(set(ids)) == 1
    assert ident.peer_id_of(ident.private_key_from_bytes(home.identity_file.read_bytes())) == ids[0]


def test_two_daemons_started_at_once_on_a_fresh_home(tmp_path) -> None:
    """Both `peer start` at the same moment on a home that has no key yet: one runs, the other is refused
    before it creates a key, and the key on disk is the one the running daemon uses."""
    home = tmp_path / "h"
    cfg = config_file(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False)
    ds = [DaemonProcess.create(f"d{i}", home, config=cfg, args=["--listen", "127.0.0.1:0"],
                               log_path=tmp_path / f"d{i}.log") for i in range(2)]
    try:
        for d in ds:
            d.start()
        wait_for(lambda: sum(d.running for d in ds) == 1, timeout=60, what="one of the two daemons to give up")
        loser = next(d for d in ds if not d.running)
        winner = next(d for d in ds if d.running)
        assert loser.wait_stopped(10) == 2 and "already running with this home" in loser.log_tail()
        status = winner.wait_ready()
        on_disk = ident.peer_id_of(ident.private_key_from_bytes(Home(home).identity_file.read_bytes()))
        assert status["peer_id"] == on_disk
        assert winner.stop() == 0
    finally:
        for d in ds:
            d.kill()


def test_a_swarm_asking_work_of_keys_makes_a_new_key_so_and_refuses_a_weaker_one_with_the_fix(tmp_path) -> None:
    home = Home(tmp_path / "h")
    key = home.load_or_create_identity(8)  # [membership] identity_bits = 8: ~256 keys drawn
    assert ident.identity_work(ident.public_key_bytes(key)) >= 8
    weak = Home(tmp_path / "weak")
    old = next(k for k in iter(ident.generate_identity, None) if ident.identity_work(ident.public_key_bytes(k)) < 8)
    weak.ensure()
    create_exclusive(weak.identity_file, ident.private_key_to_bytes(old), mode=0o600)
    with pytest.raises(HomeError, match=r"bits of work and this swarm asks \[membership\] identity_bits = 8.*Move the key away"):
        weak.load_or_create_identity(8)
    assert ident.peer_id_of(weak.load_or_create_identity(0)) == ident.peer_id_of(old)  # kept, untouched
