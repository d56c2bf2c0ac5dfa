"""How much a remote peer may make us hold in memory.

A peer is anyone who completed the handshake, including a buggy or hostile one.
Everything it sends is a request for us to allocate: a frame buffer, a decoded
message, a tensor. `WireLimits` bounds each of those requests so that the memory
a session can pin is bounded no matter what arrives (docs/design.md, "Invariants",
6); the decoders check the limits *before* they allocate.

The chunk size senders use by default is here too, beside the frame limit that must hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_LIMITS", "GiB", "KiB", "MiB", "WireLimits"]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DEFAULT_CHUNK_SIZE = 1 * MiB
"""Body bytes per tensor chunk frame unless the sender says otherwise (the encoder's, the transport's and
`[gossip] chunk_kib`'s default). 1 MiB: 2 and 4 MiB chunks made an averaging exchange no faster (docs/benchmarks.md,
the 2026-11-22 average entry), and a smaller frame lets messages queued behind a bulk transfer go sooner (a session's send
lock is taken per frame)."""


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds on what one remote peer can make us allocate.

    Frame and message limits bound the control plane; tensor limits bound the
    data plane. The msgpack limits (str/bin/array/map) are passed to the
    unpacker, so a tiny message cannot claim a huge container either.
    """

    max_frame_bytes: int = 4 * MiB + 64
    """Plaintext bytes of one frame (a 4 MiB chunk plus header slack): senders may use chunks up to 4 MiB
    (frames that large seal ~17% cheaper than 64 KiB ones), though `DEFAULT_CHUNK_SIZE` is 1 MiB."""
    max_message_bytes: int = 1 * MiB
    """Encoded bytes of one msgpack control message."""
    max_tensor_bytes: int = 8 * GiB
    """Bytes of one tensor, both as sent (body) and as decoded in memory."""
    max_str_len: int = 64 * KiB
    max_bin_len: int = 1 * MiB
    max_array_len: int = 100_000
    max_map_len: int = 10_000
    max_inflight_tensor_bytes: int = 16 * GiB
    """Decoded bytes of all tensors being received on one session at once."""
    max_queued_messages: int = 1024
    """Decoded messages waiting for the application on one session (and open tensor streams)."""
    max_queued_message_bytes: int = 16 * MiB
    """Decoded bytes (Python objects, as `sys.getsizeof` counts them) of the messages waiting for the
    application on one session: 16 MiB holds a full queue of ordinary control messages (a few hundred
    bytes each) many times over, while a peer flooding maximum-size messages is paused after a few."""
    max_daemon_inflight_tensor_bytes: int = 32 * GiB
    """Decoded bytes of all tensors being received on all sessions of one daemon at once: two sessions'
    full budgets, so a daemon averaging a model of a few GiB with several neighbours at once fits, while
    many peers together cannot pin more than this. A per-session budget configured larger raises it to
    that (`peer.session.streams.TensorBudget.for_limits`)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass; `max_str_len=True` is a bug, not a limit of 1.
            if type(value) is not int or value <= 0:
                raise ValueError(f"WireLimits.{f.name} must be a positive int, got {value!r}")
        if self.max_message_bytes > self.max_frame_bytes:
            raise ValueError(
                "WireLimits.max_message_bytes must fit in one frame "
                f"({self.max_message_bytes} > max_frame_bytes {self.max_frame_bytes})"
            )
        if self.max_tensor_bytes > self.max_inflight_tensor_bytes:
            raise ValueError(
                "WireLimits.max_tensor_bytes must fit in the per-session in-flight budget "
                f"({self.max_tensor_bytes} > max_inflight_tensor_bytes "
                f"{self.max_inflight_tensor_bytes})"
            )


DEFAULT_LIMITS = WireLimits()
"""The limits a daemon uses unless its config says otherwise (immutable)."""
