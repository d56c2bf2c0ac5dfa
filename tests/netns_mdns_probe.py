"""Run one MdnsDiscovery and report what it finds, as JSON lines on stdout.

Used by the tests as a separate process, either on loopback (``--interfaces
127.0.0.1``) or inside a network namespace with zeroconf's default interfaces.
Events: {"event": "started"}, {"event": "found", "peer_id", "addresses"},
{"event": "done", "found": [...]} once `--expect` peers were seen, {"event":
"timeout", "found": [...]}.  After "done" it keeps announcing until stdin closes
(so slower peers can still find it) or `--timeout` runs out; exit 0 iff done.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `peer` importable

from peer.membership.mdns import Announcement, MdnsDiscovery  # noqa: E402


def _in_named_netns() -> bool:
    """True if we run inside a namespace made by `ip netns add` (its nsfs file has our inode)."""
    try:
        me = os.stat("/proc/self/ns/net")
        for name in os.listdir("/run/netns"):
            st = os.stat(os.path.join("/run/netns", name))
            if (st.st_dev, st.st_ino) == (me.st_dev, me.st_ino):
                return True
    except OSError:
        pass
    return False


def _emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def _stdin_closed() -> None:
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass


async def main(args: argparse.Namespace) -> int:
    interfaces = args.interfaces.split(",") if args.interfaces else None
    disc = MdnsDiscovery(peer_id=args.peer_id, swarm=args.swarm, port=args.port,
                         protocol_version=args.pv, interfaces=interfaces)
    send, recv = trio.open_memory_channel[Announcement](64)
    seen: dict[str, Announcement] = {}
    done = False
    with trio.move_on_after(args.timeout):
        async with trio.open_nursery() as nursery:
            await nursery.start(disc.run, send)
            _emit(event="started", peer_id=args.peer_id)
            async for ann in recv:
                if ann.peer_id not in seen:
                    _emit(event="found", peer_id=ann.peer_id, addresses=[list(a) for a in ann.addresses])
                seen[ann.peer_id] = ann
                if len(seen) >= args.expect:
                    done = True
                    _emit(event="done", found=sorted(seen))
                    await _stdin_closed()
                    nursery.cancel_scope.cancel()
                    break
    if not done:
        _emit(event="timeout", found=sorted(seen))
    return 0 if done else 3


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer-id", required=True)
    parser.add_argument("--swarm", default="probe")
    parser.add_argument("--port", type=int, default=7000)
    parser.add_argument("--pv", type=int, default=1)
    parser.add_argument("--expect", type=int, required=True, help="number of other peers to find")
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--interfaces", default="", help="comma list; empty = zeroconf default (namespaces only)")
    parser.add_argument("--debug", action="store_true")
    ns = parser.parse_args()
    if not ns.interfaces and not _in_named_netns():
        sys.exit("refusing default interfaces outside a named network namespace: pass --interfaces 127.0.0.1")
    logging.basicConfig(level=logging.DEBUG if ns.debug else logging.WARNING, stream=sys.stderr,
                        format="%(relativeCreated)6d %(name)s %(message)s")
    if ns.debug:
        logging.getLogger("zeroconf").setLevel(logging.INFO)
        logging.getLogger("asyncio").setLevel(logging.INFO)
    sys.exit(trio.run(main, ns))
