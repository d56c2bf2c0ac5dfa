"""A daemon's home directory: identity key, config snapshot, peer cache, checkpoints, logs, control socket.

Everything written here goes through `atomic_write` (temp file, fsync, rename, fsync dir), so a crash
at any moment leaves either the old file or the new one, never a torn one (docs/design.md, "Invariants", 7).

A home holds the identity key and checkpoints the daemon loads, so it is refused when another user owns
it or anyone but its owner can write it (they could plant or swap those files). One daemon claims a home
(`Home.claim`, an flock held for the daemon's life) before it creates or reads the identity key, and the
key is created with link() (fails if it exists), so two daemons started at once never make two keys.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from peertrain.swarm import LATEST_CHECKPOINT
from protocol import identity as ident

log = logging.getLogger("peertrain.daemon")


class HomeError(Exception):
    """The home directory is unusable; the message says what to do."""


def atomic_write(path: Path, data: bytes | Callable[[BinaryIO], Any], *, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that readers see the old or the new content, never a mix. `data` may be a
    function that writes into the open temp file (`torch.save(state, f)`): a large state then goes to disk
    without a second copy of it in memory."""
    path = Path(path)
    tmp = _write_temp(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _write_temp(path: Path, data: bytes | Callable[[BinaryIO], Any], mode: int) -> str:
    """A fsynced temp file beside `path` holding `data` (its name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def create_exclusive(path: Path, data: bytes, *, mode: int = 0o600) -> bool:
    """Create `path` holding `data` whole, only if it does not exist yet; False if another writer got there
    first (its file is left as it is). link() is the atomic "create if absent" for a complete file."""
    path = Path(path)
    tmp = _write_temp(path, data, mode)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    _fsync_dir(path.parent)
    return True


@dataclass
class HomeClaim:
    """One daemon's hold on a home: an exclusive flock on its lock file, released when the daemon's process
    exits (however it exits, so a crash leaves nothing stale) or on `release`."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class Home:
    """Paths inside one daemon's home directory (created on first use): every file name in a home is
    spelled here and nowhere else."""

    root: Path

    LATEST_CHECKPOINT = LATEST_CHECKPOINT  # a job's current state (named with the Swarm API: peertrain/swarm.py)

    @property
    def identity_file(self) -> Path:
        return self.root / "identity.key"

    @property
    def lock_file(self) -> Path:
        """What `claim` locks: the one daemon that holds it owns this home."""
        return self.root / "daemon.lock"

    @property
    def control_socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def config_snapshot(self) -> Path:
        return self.root / "config.snapshot.toml"

    @property
    def peer_cache(self) -> Path:
        return self.root / "peers.msgpack"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_checkpoint(self) -> Path:
        return self.checkpoints / self.LATEST_CHECKPOINT

    @property
    def stage_copies(self) -> Path:
        """Copies of pipeline stages this daemon keeps on disk (peer/pipeline/state_transfer.py); emptied at start."""
        return self.root / "stage-copies"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def log_file(self) -> Path:
        """The daemon's output, where a launcher (`peer local`, tests, benches) puts it."""
        return self.root / "daemon.log"

    @property
    def launch_config(self) -> Path:
        """The config file a launcher wrote for this daemon (`peer start --config` reads it; the daemon's
        own record of what it ran with is `config_snapshot`)."""
        return self.root / "config.toml"

    def ensure(self) -> "Home":
        """Create the directory (mode 0700), or explain why it cannot be used: not ours, or writable by others."""
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = os.stat(self.root)
        except OSError as exc:
            raise HomeError(f"cannot create home directory {self.root}: {exc.strerror}; pick another with --home") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise HomeError(f"home {self.root} is not a directory; pick another with --home")
        if st.st_uid != os.geteuid():
            raise HomeError(f"home directory {self.root} is owned by uid {st.st_uid}, not by this user (uid "
                            f"{os.geteuid()}): whoever owns it can replace the identity key and checkpoints; "
                            f"`chown {os.geteuid()} {self.root}` if it is yours, or pick another with --home")
        if st.st_mode & 0o022:
            raise HomeError(f"home directory {self.root} is writable by {'group' if st.st_mode & 0o020 else 'others'} "
                            f"(mode {stat.S_IMODE(st.st_mode):04o}): they could replace the identity key and "
                            f"checkpoints; `chmod 700 {self.root}`, or pick another with --home")
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise HomeError(f"home directory {self.root} is not readable and writable by this user; fix its permissions or pick another with --home")
        return self

    def claim(self) -> HomeClaim:
        """Make this process the one daemon of this home, or refuse if another holds it; do it before the
        identity key is created or read, so two daemons started at once never both run as this home."""
        self.ensure()
        path = self.lock_file
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise HomeError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HomeError(f"a daemon is already running with this home ({self.root}); stop it with "
                            f"`peer stop --home {self.root}` or choose another --home") from None
        return HomeClaim(path, fd)

    def _read_identity(self):
        path = self.identity_file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HomeError(f"cannot read identity key {path}: {exc.strerror}") from exc
        try:
            key = ident.private_key_from_bytes(data)
        except ValueError as exc:
            raise HomeError(f"identity key {path} is corrupt ({exc}); move it away to create a new identity (a new peer ID)") from exc
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            os.chmod(path, 0o600)
        return key

    def load_or_create_identity(self, bits: int = 0):
        """The Ed25519 identity key: created once (mode 0600), then the same peer ID forever; a new one carries
        `bits` of work (`[membership] identity_bits`); an existing one with less is refused, with the fix.
        Creation is exclusive: if another process creates it first, its key is the one returned."""
        self.ensure()
        key = self._read_identity()
        if key is None:
            key = self._create_identity(bits)
        work = ident.identity_work(ident.public_key_bytes(key))
        if work < bits:
            raise HomeError(f"identity key {self.identity_file} carries {work} bits of work and this swarm asks "
                            f"[membership] identity_bits = {bits}: its peers would refuse it. Move the key away "
                            f"(a new peer ID) and start again: a key with {bits} bits is made")
        return key

    def _create_identity(self, bits: int):
        if bits:
            log.info("making an identity key with %d bits of work ([membership] identity_bits): about 2^%d "
                     "keys drawn, once", bits, bits)
        key = ident.generate_identity(bits)
        if create_exclusive(self.identity_file, ident.private_key_to_bytes(key), mode=0o600):
            return key
        return self._read_identity()


def default_home() -> Path:
    """`$PEERTRAIN_HOME`, else ~/.peertrain."""
    env = os.environ.get("PEERTRAIN_HOME")
    return Path(env) if env else Path.home() / ".peertrain"
