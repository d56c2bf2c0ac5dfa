"""A daemon's home directory: identity key, config snapshot, peer cache, checkpoints, logs, control socket.

Everything written here goes through `atomic_write` (temp file, fsync, rename, fsync dir), so a crash
at any moment leaves either the old file or the new one, never a torn one (docs/design.md, "Invariants", 7).
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from protocol import identity as ident


class HomeError(Exception):
    """The home directory is unusable; the message says what to do."""


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class Home:
    """Paths inside one daemon's home directory (created on first use): every file name in a home is
    spelled here and nowhere else."""

    root: Path

    LATEST_CHECKPOINT = "latest.pt"  # a trainer's current state; `peer export` and restarts read it

    @property
    def identity_file(self) -> Path:
        return self.root / "identity.key"

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
        """Create the directory (mode 0700) or explain why it cannot be used."""
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise HomeError(f"cannot create home directory {self.root}: {exc.strerror}; pick another with --home") from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise HomeError(f"home directory {self.root} is not readable and writable by this user; fix its permissions or pick another with --home")
        return self

    def load_or_create_identity(self):
        """The Ed25519 identity key: created once (mode 0600), then the same peer ID forever."""
        path = self.identity_file
        if path.exists():
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise HomeError(f"cannot read identity key {path}: {exc.strerror}") from exc
            try:
                key = ident.private_key_from_bytes(data)
            except ValueError as exc:
                raise HomeError(f"identity key {path} is corrupt ({exc}); move it away to create a new identity (a new peer ID)") from exc
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                os.chmod(path, 0o600)
            return key
        self.ensure()
        key = ident.generate_identity()
        atomic_write(path, ident.private_key_to_bytes(key), mode=0o600)
        return key


def default_home() -> Path:
    """`$PEERTRAIN_HOME`, else ~/.peertrain."""
    env = os.environ.get("PEERTRAIN_HOME")
    return Path(env) if env else Path.home() / ".peertrain"
