"""`peer bench transport`: how close the encrypted channel gets to the cipher's own speed.

One child process listens on two ports over 127.0.0.1: one with normal sealed sessions, one whose
sessions (after the same authenticated handshake) send frames unencrypted — the `plain_tcp_gbps`
baseline of the same code path. The parent streams a float32 tensor of `--size` bytes through the real
`Session.send_tensor` and waits for the child's acknowledgement (a reply sent after the tensor was
fully received and decoded), for several rounds after a warm-up; it also measures one core sealing
the same bytes in memory. `ratio_to_aead = encrypted_gbps / aead_seal_gbps`.

`both_ways_seconds` is what a pairwise averaging exchange moves, without its snapshot and update: both
processes stream a tensor of `--size` bytes to each other at once over one sealed session. It is the
floor under `peer bench average --peers 2` on the same machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import trio

from peer.bench.args import parse_size
from peer.concurrency import together
from peer.session.cipher_choice import resolve_ciphers, seal_gbps
from peer.session.connect import dial, open_listeners, serve
from peer.session.transport import SessionClosed, TransportConfig
from protocol.identity import generate_identity
from protocol.limits import WireLimits
from protocol.schema import Ping, Pong


def _transport_config(cipher: str, chunk: int, plain: bool) -> TransportConfig:
    return TransportConfig(identity=generate_identity(), swarm="bench", ciphers=(cipher,),
                           limits=WireLimits(max_frame_bytes=max(chunk, 1 << 16) + 64),
                           chunk_bytes=chunk, insecure_plaintext_for_benchmark=plain)


BOTH_WAYS = -1.0  # a Ping with this `sent` asks the child to send its own tensor while it receives


async def _serve(cipher: str, chunk: int, size: int) -> None:
    async def on_session(session):
        mine = None
        async with trio.open_nursery() as n:
            n.start_soon(session.run)
            expected = 1
            session.expect(expected)  # the client's tensor comes before its ping: expect it ahead
            async for env in session.incoming:
                if isinstance(env.message, Ping):
                    try:
                        if env.message.sent == BOTH_WAYS:
                            if mine is None:
                                mine = np.random.default_rng(1).standard_normal(size // 4, dtype=np.float32)
                            await together(lambda: session.send_tensor("back", mine),
                                           lambda: session.receive_tensor(expected, timeout=120))
                        else:
                            await session.receive_tensor(expected, timeout=120)
                        expected += 1
                        session.expect(expected)
                        await session.reply(env, Pong(echo=env.message.sent))
                    except SessionClosed:
                        break
            n.cancel_scope.cancel()

    sealed, sealed_addr = await open_listeners("127.0.0.1", 0)
    plain, plain_addr = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as n:
        n.start_soon(serve, sealed, _transport_config(cipher, chunk, False), on_session)
        n.start_soon(serve, plain, _transport_config(cipher, chunk, True), on_session)
        print(json.dumps({"sealed": sealed_addr[1], "plain": plain_addr[1]}), flush=True)
        # exit when the parent closes our stdin
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        n.cancel_scope.cancel()


async def _client(port: int, cipher: str, chunk: int, plain: bool, tensor, rounds: int,
                  both_ways: bool = False) -> list[float]:
    session = await dial("127.0.0.1", port, _transport_config(cipher, chunk, plain))
    times = []
    async with trio.open_nursery() as n:
        n.start_soon(session.run)
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            if both_ways:  # theirs arrives on their i+1-th stream; their reply comes once they have ours
                await together(lambda: session.request(Ping(sent=BOTH_WAYS), timeout=120),
                               lambda: session.send_tensor("bench", tensor),
                               lambda: session.receive_tensor(i + 1, timeout=120))
            else:
                await session.send_tensor("bench", tensor)
                await session.request(Ping(sent=0.0), timeout=120)
            if i > 0:  # the first round is the warm-up
                times.append(time.perf_counter() - t0)
        await session.aclose("done")
        n.cancel_scope.cancel()
    return times


def run(args) -> int:
    if args.serve:
        trio.run(_serve, args.cipher, parse_size(args.chunk), parse_size(args.size))
        return 0
    size = parse_size(args.size)
    chunk = parse_size(args.chunk)
    cipher = resolve_ciphers([args.cipher])[0]
    tensor = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
    # Not a ManagedProcess: the child talks to us over its stdin/stdout pipes (its ports out, and closing
    # its stdin is how it is told to stop), where a ManagedProcess sends its output to a log file.
    child = subprocess.Popen([sys.executable, "-m", "peer", "bench", "transport", "--serve", "--cipher", cipher,
                              "--chunk", str(chunk), "--size", str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        ports = json.loads(child.stdout.readline())
        enc = trio.run(_client, ports["sealed"], cipher, chunk, False, tensor, args.rounds)
        pln = trio.run(_client, ports["plain"], cipher, chunk, True, tensor, args.rounds)
        both = trio.run(_client, ports["sealed"], cipher, chunk, False, tensor, args.rounds, True)
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
    nbytes = tensor.nbytes
    seconds = statistics.median(enc)
    encrypted = nbytes / seconds / 1e9
    plain = nbytes / statistics.median(pln) / 1e9
    aead = seal_gbps(cipher, chunk, min_seconds=0.5)
    result = {
        "payload_bytes": nbytes, "seconds": round(seconds, 4), "rounds": args.rounds, "chunk_bytes": chunk,
        "encrypted_gbps": round(encrypted, 3), "plain_tcp_gbps": round(plain, 3),
        "aead_seal_gbps": round(aead, 3), "ratio_to_aead": round(encrypted / aead, 3), "cipher": cipher,
        "both_ways_seconds": round(statistics.median(both), 4),
        "notes": {"both_ways_seconds": "median seconds for both processes to stream payload_bytes to each other at "
                                       "once over one sealed session: the transfers of a pairwise averaging "
                                       "exchange, without its snapshot and update (a floor under peer bench average)"},
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
