"""The message schemas peertrain speaks, and the registry that decodes them.

Each module here holds the messages of one plane; `MESSAGES` lists them all
explicitly (add new schema modules' classes to it) and `DEFAULT_REGISTRY` is
built from it once.
"""

from __future__ import annotations

from protocol.messages import Message, Registry
from protocol.schema.session import (
    ErrorReply,
    Goodbye,
    PeerExchange,
    PeerRecord,
    Ping,
    Pong,
    peer_record_signing_bytes,
)
from protocol.schema.gossip import (
    AverageAbort,
    AverageAccept,
    AverageCommit,
    AverageOffer,
    AverageReject,
    ParamsReply,
    ParamsRequest,
    TensorSpec,
    UpdatePush,
    UpdateTaken,
)
from protocol.schema.nat import (
    DialBackReply,
    DialBackRequest,
    DialBackResult,
    PunchOffer,
    PunchSync,
    RelayAck,
    RelayConnect,
    RelayConnectReply,
    RelayIncoming,
    RelayReservation,
    RelayReserve,
)
from protocol.schema.pipeline import (BlockProfile, StageAck, StageAckReply, StageAnnouncement, StageCall, StageCopy, StageReply,
                                      StageStateReply, StageStateRequest)
from protocol.schema.tensor import TensorCancel, TensorHeader
from protocol.schema.topology import (
    EdgeAccept,
    EdgeCommit,
    EdgeDrop,
    EdgePropose,
    EdgeReject,
    LinkReport,
    ProbeReply,
    ProbeRequest,
    TopologyRecord,
    TopologyRecords,
    topology_record_signing_bytes,
)
from protocol.schema.views import (
    Disconnect,
    GapRound,
    Join,
    JoinReply,
    JoinWalk,
    NeighbourReply,
    NeighbourRequest,
    Seek,
    Shuffle,
    ShuffleReply,
    Status,
    SwapReply,
    SwapRequest,
    WalkEnd,
)

__all__ = [
    "DEFAULT_REGISTRY",
    "MESSAGES",
    "ErrorReply",
    "Goodbye",
    "PeerExchange",
    "PeerRecord",
    "Ping",
    "Pong",
    "TensorCancel",
    "TensorHeader",
    "peer_record_signing_bytes",
    "AverageAbort", "AverageAccept", "AverageCommit", "AverageOffer", "AverageReject", "ParamsReply", "ParamsRequest", "TensorSpec",
    "UpdatePush", "UpdateTaken",
    "EdgeAccept", "EdgeCommit", "EdgeDrop", "EdgePropose", "EdgeReject", "LinkReport", "ProbeReply", "ProbeRequest",
    "TopologyRecord", "TopologyRecords", "topology_record_signing_bytes",
    "DialBackReply", "DialBackRequest", "DialBackResult", "PunchOffer", "PunchSync", "RelayAck", "RelayConnect",
    "RelayConnectReply", "RelayIncoming", "RelayReservation", "RelayReserve",
    "BlockProfile", "StageAck", "StageAckReply", "StageAnnouncement", "StageCall", "StageCopy", "StageReply", "StageStateReply",
    "StageStateRequest",
    "Disconnect", "GapRound", "Join", "JoinReply", "JoinWalk", "NeighbourReply", "NeighbourRequest", "Seek", "Shuffle",
    "ShuffleReply", "Status", "SwapReply", "SwapRequest", "WalkEnd",
]

MESSAGES: tuple[type[Message], ...] = (
    # session plane
    Ping,
    Pong,
    PeerRecord,
    PeerExchange,
    Goodbye,
    ErrorReply,
    # data plane
    TensorHeader,
    TensorCancel,
    # topology plane
    TopologyRecord,
    TopologyRecords,
    EdgePropose,
    EdgeAccept,
    EdgeReject,
    EdgeCommit,
    EdgeDrop,
    ProbeRequest,
    ProbeReply,
    # gossip plane
    AverageOffer,
    AverageAccept,
    AverageReject,
    AverageCommit,
    AverageAbort,
    ParamsRequest,
    ParamsReply,
    UpdatePush,
    UpdateTaken,
    # pipeline plane
    StageCall,
    StageReply,
    StageStateRequest,
    StageStateReply,
    StageAck,
    StageAckReply,
    # reachability plane (dial-back, relays, hole punching)
    DialBackRequest,
    DialBackReply,
    RelayReserve,
    RelayReservation,
    RelayConnect,
    RelayConnectReply,
    RelayIncoming,
    RelayAck,
    PunchOffer,
    PunchSync,
    # partial-view plane (peer/membership/views.py) and its gap estimate (peer/topology/local_gap.py)
    Join,
    JoinReply,
    JoinWalk,
    WalkEnd,
    Seek,
    NeighbourRequest,
    NeighbourReply,
    SwapRequest,
    SwapReply,
    Disconnect,
    Shuffle,
    ShuffleReply,
    Status,
    GapRound,
)

DEFAULT_REGISTRY = Registry(MESSAGES)
