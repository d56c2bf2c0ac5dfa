"""A peer that speaks the real protocol with a fresh identity, for attack tests and `peer bench hostile`.

Every peer may be hostile (docs/design.md, "Invariants", 6): tests of a bound reproduce the attack
against a real daemon. `attacker_session` completes a genuine handshake with a daemon (from its status:
listen port, swarm) as a brand-new identity and yields the `Session`, whose reader runs in the
background, so a test can send whatever typed messages or tensors it likes (`send_message`, `request`,
`send_tensor`, `new_stream_id`) and see whether the daemon keeps its bounds. Raw bytes past the
handshake go through `Session._send_frame`; nothing here bypasses the cipher.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from peer.session.connect import dial
from peer.session.transport import Session, TransportConfig
from protocol import identity as ident

DIAL_TIMEOUT = 10.0  # a daemon on a loaded 2-core machine completes a handshake well within this


def attacker_config(swarm: str, **kw) -> TransportConfig:
    """A TransportConfig for a throwaway identity in `swarm` (pass psk=..., limits=..., app_payload=..., or an
    identity=... of its own)."""
    kw.setdefault("identity", ident.generate_identity())
    return TransportConfig(swarm=swarm, **kw)


@asynccontextmanager
async def attacker_session(status: dict, *, host: str = "127.0.0.1", reading: bool = True,
                           source: str | None = None, **config) -> AsyncIterator[Session]:
    """A live session to the daemon whose `peer status --json` is `status`, as a fresh identity.

    The session's reader runs until the block ends (then the session is closed) or the daemon closes it
    (then `session.closed` is set and sends raise SessionClosed). With `reading=False` nothing reads the
    socket at all (a peer that stopped reading): what the daemon sends piles up in the kernel's buffers,
    and `session.closed` is set only when a send of ours fails. `source`: the local address to dial from
    (on loopback any 127.x.y.z, to play a peer at another IP)."""
    port = int(str(status["listen"]).rsplit(":", 1)[1])
    cfg = attacker_config(status["swarm"], **config)
    session = await dial(host, port, cfg, expected_peer_id=status["peer_id"], connect_timeout=DIAL_TIMEOUT,
                         local_address=source)
    async with trio.open_nursery() as nursery:
        if reading:
            nursery.start_soon(session.run)
        try:
            yield session
        finally:
            with trio.CancelScope(shield=True):
                await session.aclose("attack over")
            nursery.cancel_scope.cancel()
