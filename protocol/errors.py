"""Errors raised by the wire protocol.

Every way a remote peer can misbehave ends in one of these, never in a crash of
the daemon: the transport catches `ProtocolError`, logs its message as the reason
and closes that one session.
"""


class ProtocolError(Exception):
    """The remote side sent something we will not accept; close the session."""


class HandshakeError(ProtocolError):
    """The handshake failed: wrong keys, wrong swarm key, bad identity, refused peer."""


class AuthenticationError(ProtocolError):
    """A sealed frame failed authentication: tampered, replayed, reordered or truncated."""


class LimitExceeded(ProtocolError):
    """The remote side asked us to hold more than a configured limit allows."""
