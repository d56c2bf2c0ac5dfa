"""A failed dial, told as one line of cause and one line of fix, both naming the address.

`peer doctor` and the daemon's bootstrap status show these to people, who should not need to know that
"handshake authentication failed" means the two machines hold different swarm keys. What the dialing
side can see is limited, and the texts say so: a responder that refuses our handshake (another swarm
key, swarm name, protocol version or cipher list) just hangs up, so the dialer reads "connection closed
during the handshake" and the responder's log holds the exact reason.
"""

from __future__ import annotations

import errno
import re
import socket
from dataclasses import dataclass

import trio

from protocol.errors import ProtocolError

SAME_KEY = ("both sides need the same [security] swarm_key_file contents (compare the fingerprints "
            "`peer doctor` prints on each machine)")
SAME_SWARM = "the same [daemon] swarm name on both sides"
SAME_VERSION = "the same peertrain version on both machines (`peer --version`)"
IS_IT_RUNNING = "is `peer start` running on that host and listening on that port? ([daemon] listen)"
OPEN_PORT = "open TCP {port} on that host's firewall, or forward it on its router"

# When one dial tried several addresses (IPv4 and IPv6 of a name), the most telling failure speaks for all:
# a refusal proves the host is up, a timeout points at a firewall, unreachable networks say the least.
_ERRNO_ORDER = (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ECONNRESET, errno.EPIPE,
                errno.ENETUNREACH)


@dataclass(frozen=True)
class DialProblem:
    cause: str
    fix: str


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _leaves(exc: BaseException) -> list[BaseException]:
    """The errors inside exception groups, and inside trio's "all attempts to connect failed" OSError
    (its errno is None; the per-address errors are its __cause__)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    if isinstance(exc, OSError) and exc.errno is None and isinstance(exc.__cause__, BaseExceptionGroup):
        return _leaves(exc.__cause__) or [exc]
    return [exc]


def _telling(exc: BaseException) -> BaseException:
    leaves = _leaves(exc)
    for code in _ERRNO_ORDER:
        for leaf in leaves:
            if isinstance(leaf, OSError) and leaf.errno == code:
                return leaf
    return leaves[0] if leaves else exc


def explain_dial_error(exc: BaseException, host: str, port: int, *, timeout: float) -> DialProblem:
    """Why dialing host:port failed with `exc` (from `peer.session.connect.dial` or resolving), and
    what to try."""
    where = hostport(host, port)
    exc = _telling(exc)
    if isinstance(exc, socket.gaierror):
        return DialProblem(f"cannot resolve {host} ({exc.strerror or exc}), so {where} was not dialed",
                           f"check the host name in [daemon] join / --join, and this machine's DNS "
                           f"(`getent hosts {host}`)")
    if isinstance(exc, (trio.TooSlowError, TimeoutError)) or getattr(exc, "errno", None) == errno.ETIMEDOUT:
        return DialProblem(f"no answer from {where} within {timeout:g} s: the host is down, or a firewall or "
                           "NAT drops the connection", OPEN_PORT.format(port=port) + "; check the host is up")
    if isinstance(exc, ProtocolError):
        return _explain_handshake(str(exc), where)
    if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
        return _closed(where)
    code = getattr(exc, "errno", None)
    if code == errno.ECONNREFUSED:
        return DialProblem(f"{where} refused the connection: the host is up but nothing listens on port {port}",
                           IS_IT_RUNNING)
    if code == errno.EHOSTUNREACH:
        return DialProblem(f"no route to host {where}: it is down or off the network, or a firewall rejects us",
                           "check that the host is up and the address is right; " + OPEN_PORT.format(port=port))
    if code == errno.ENETUNREACH:
        return DialProblem(f"network unreachable: this machine has no route to {where}",
                           "check this machine's network connection (for an IPv6 address: does this machine "
                           "have IPv6?), or join an address on a network it can reach")
    if code in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
        return _closed(where)
    if isinstance(exc, OSError):
        return DialProblem(f"cannot connect to {where}: {exc.strerror or exc}",
                           IS_IT_RUNNING + "; " + OPEN_PORT.format(port=port))
    return DialProblem(f"dialing {where} failed: {type(exc).__name__}: {exc}",
                       "run both daemons with --log-level debug and compare their logs")


def _closed(where: str) -> DialProblem:
    return DialProblem(f"{where} hung up during the handshake: it refused us, most often for a different swarm "
                       "key (without the same [security] swarm_key_file it cannot even read our first message), "
                       "else another swarm name, protocol version or cipher list (its log says which)",
                       f"{SAME_KEY}; {SAME_SWARM}; {SAME_VERSION}")


def _explain_handshake(msg: str, where: str) -> DialProblem:
    """Each HandshakeError protocol/handshake.py (and protocol/noise.py) raises, as the dialer meets it;
    the responder-side ones too, for daemons that report them."""
    if msg.startswith("handshake already failed: "):
        return _explain_handshake(msg.removeprefix("handshake already failed: "), where)
    if msg.startswith("connection closed"):
        return _closed(where)
    if "handshake authentication failed" in msg:
        return DialProblem(f"{where} answered, but its handshake does not match ours: a different swarm key "
                           "or swarm name (each is mixed into the handshake)", f"{SAME_KEY}; {SAME_SWARM}")
    if "only the remote uses a swarm key" in msg:
        return DialProblem(f"{where} sent a handshake we cannot read: only one side uses a swarm key",
                           SAME_KEY)
    if msg.startswith("remote speaks protocol version"):
        return DialProblem(f"{where} {msg.removeprefix('remote ')}", SAME_VERSION)
    if msg.startswith("no cipher in common"):
        return DialProblem(f"no cipher in common with {where}: {msg.partition(': ')[2]}",
                           "list a cipher both sides accept in [security] ciphers (or 'auto' on both)")
    if "allow-list" in msg:
        peer = msg.removeprefix("peer ").partition(" ")[0]
        return DialProblem(f"{where} is peer {peer}, which is not on the allow-list ([security] allow_peers)",
                           f"if it belongs in the swarm, add {peer} to [security] allow_peers on the side "
                           "that refuses (each side checks the other against its own list)")
    if "bits of work; this swarm asks" in msg:
        return DialProblem(f"{where} refused a key without enough work: {msg}",
                           "the same [membership] identity_bits on every peer of the swarm; a peer whose key was "
                           "made before it was set needs a new key (move its identity key away: a new peer ID)")
    if msg.startswith("expected peer"):
        words = msg.split()
        expected, actual = words[2], words[-1]
        return DialProblem(f"{where} is now peer {actual}, not {expected}: the address belongs to another "
                           "daemon (a new identity or home there, or another machine took the address)",
                           "nothing to do if that machine got a new identity (the old address is forgotten); "
                           "else remove the stale address from [daemon] join")
    if any(t in msg for t in ("did not offer", "signature does not cover", "no valid Ed25519", "payload is not a map")):
        return DialProblem(f"{where} broke the handshake rules ({msg}): not a peertrain daemon, or an impostor",
                           "check that this address is the daemon you mean; do not trust what answers there")
    if msg.startswith("malformed") or "too short" in msg or "invalid X25519" in msg or "exceeds" in msg:
        return DialProblem(f"{where} does not speak the peertrain handshake ({_first_bytes(msg) or msg})",
                           f"check that {where} is the daemon's port ([daemon] listen) and not another "
                           f"service; {SAME_VERSION}")
    return DialProblem(f"handshake with {where} failed: {msg}", f"{SAME_KEY}; {SAME_SWARM}; {SAME_VERSION}")


def _first_bytes(msg: str) -> str:
    """Another service answering reads as a huge handshake length: its first 4 bytes, e.g. 'HTTP' for a web
    server or proxy. Those bytes as text when they are printable, else ""."""
    m = re.search(r"message of (\d+) bytes", msg)
    if m is None or int(m.group(1)) >= 1 << 32:
        return ""
    head = int(m.group(1)).to_bytes(4, "big")
    return f"it began with {head.decode()!r}: another kind of server" if all(32 <= b < 127 for b in head) else ""
