"""The sparse codec (protocol/tensor_codec.py): top-k per chunk, 2-bit values. What travels is exactly each
chunk's k largest entries' positions and signs, with one of the chunk's two magnitudes; the body's size is known
from the header; a hostile body (indices out of order or range, negative magnitudes, NaN) is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.schema import DEFAULT_REGISTRY
from protocol.tensor_codec import (DEFAULT_SPARSE_CHUNK, DEFAULT_SPARSE_TOPK, DENSE_CODECS, pack_codes, sparse_counts,
                                   tensor_nbytes, unpack_codes)
from protocol.tensor_decoder import TensorDecoder
from protocol.tensor_encoder import TensorEncoder


def send(enc: TensorEncoder, **kw):
    header = DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(enc.header(1)), DEFAULT_LIMITS).message
    dec = TensorDecoder(header, DEFAULT_LIMITS, **kw)
    for chunk in enc.chunks():
        dec.write(chunk)
    return dec.finish().array


def body(enc: TensorEncoder) -> bytes:
    return b"".join(bytes(c) for c in enc.chunks())


def decode(enc: TensorEncoder, raw: bytes, **kw):
    dec = TensorDecoder(enc.header(1), DEFAULT_LIMITS, **kw)
    dec.write(raw)
    return dec.finish().array


@given(x=hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e6, 1e6, width=32)),
       block=st.integers(1, 64), topk=st.integers(1, 64), chunk_size=st.integers(1, 500))
@settings(max_examples=120, deadline=None)
def test_each_chunk_sends_its_topk_with_their_signs_and_one_of_two_magnitudes(x, block, topk, chunk_size):
    topk = min(topk, block)
    enc = TensorEncoder("d", x, codec="sparse", block=block, topk=topk, chunk_size=chunk_size)
    assert len(body(enc)) == enc.nbytes == tensor_nbytes("float32", [x.size], "sparse", block, topk)
    y = send(enc)
    for c in range(0, x.size, block):
        xs, ys = np.abs(x[c:c + block]), y[c:c + block]
        k = min(topk, xs.size)
        sent = np.flatnonzero(ys)  # (an entry sent as 0 magnitude reads as not sent: then all kept are 0)
        assert sent.size <= k
        if sent.size:  # every sent entry is at least as large as every entry left out
            left = np.setdiff1d(np.arange(xs.size), sent)
            assert not left.size or xs[sent].min() >= xs[left].max() or np.isclose(xs[sent].min(), xs[left].max())
            signed = x[c:c + block][sent] != 0  # a kept 0 reads as one of the two magnitudes, either sign
            assert (np.sign(ys[sent][signed]) == np.sign(x[c:c + block][sent][signed])).all()
            assert np.unique(np.abs(ys[sent])).size <= 2
            assert np.abs(ys[sent]).max() <= xs.max() * (1 + 1e-6)


def test_defaults_send_a_float32_tensor_in_a_hundredth_of_its_bytes():
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    enc = TensorEncoder("d", x, codec="sparse")
    assert (enc.block, enc.topk) == (DEFAULT_SPARSE_CHUNK, DEFAULT_SPARSE_TOPK)
    assert x.nbytes / enc.nbytes >= 100
    assert sparse_counts(x.size, enc.block, enc.topk) == (256, 256 * 64)


def test_body_layout_is_indices_then_packed_codes_then_two_magnitudes_per_chunk():
    x = np.array([0.1, -4.0, 0.2, 3.0, 0.0, -1.0, 0.05, 2.0], np.float32)
    enc = TensorEncoder("d", x, codec="sparse", block=4, topk=2)
    raw = body(enc)
    idx = np.frombuffer(raw[:8], "<u2")
    assert idx.tolist() == [1, 3, 1, 3]
    codes = unpack_codes(np.frombuffer(raw[8:9], np.uint8), 4)
    assert codes.tolist() == [3, 0, 2, 1]  # -4 (high, negative), 3 (low), -1 (low, negative), 2 (high)
    assert np.frombuffer(raw[9:], "<f4").tolist() == [3.0, 4.0, 1.0, 2.0]
    assert send(enc).tolist() == [0, -4, 0, 3, 0, -1, 0, 2]


def test_codes_pack_four_to_a_byte_and_back():
    codes = np.random.default_rng(1).integers(0, 4, 103).astype(np.uint8)
    packed = pack_codes(codes)
    assert packed.size == 26 and (unpack_codes(packed, 103) == codes).all()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_torch_dtypes_come_back_as_themselves(dtype):
    t = torch.randn(5000).to(getattr(torch, dtype))
    enc = TensorEncoder("t", t, codec="sparse")
    header = enc.header(1)
    got = TensorDecoder(header, DEFAULT_LIMITS)
    got.write(body(enc))
    out = got.finish().to_torch()
    assert out.dtype == t.dtype and out.shape == t.shape and int((out != 0).sum()) == 64 + 64


def test_a_chunk_with_nan_decodes_as_nan_and_is_refused_unless_allowed():
    x = np.ones(8, np.float32)
    x[5] = np.nan
    enc = TensorEncoder("d", x, codec="sparse", block=4, topk=2)
    with pytest.raises(ProtocolError, match="NaN/Inf"):
        send(enc)
    y = send(enc, allow_nonfinite=True)
    assert (y[:4][y[:4] != 0] == 1).all() and np.isnan(y[4:][y[4:] != 0]).all()


def test_sparse_needs_a_float_dtype_and_sane_parameters():
    with pytest.raises(ValueError, match="needs a float dtype"):
        TensorEncoder("d", np.zeros(3, np.int32), codec="sparse")
    with pytest.raises(ValueError, match="topk"):
        TensorEncoder("d", np.zeros(8, np.float32), codec="sparse", block=4, topk=5)
    with pytest.raises(ValueError, match="sparse block"):
        TensorEncoder("d", np.zeros(8, np.float32), codec="sparse", block=1 << 17)
    with pytest.raises(ValueError, match="topk must be 0"):
        tensor_nbytes("float32", [8], "q8", 4, 2)
    assert "sparse" not in DENSE_CODECS  # never for whole tensors (weights, activations): tensor_codec says why


def _hostile(raw: bytes, at: int, value: bytes) -> bytes:
    return raw[:at] + value + raw[at + len(value):]


def test_a_hostile_body_is_refused_naming_the_chunk():
    x = np.arange(1, 17, dtype=np.float32)
    enc = TensorEncoder("d", x, codec="sparse", block=8, topk=2)
    raw = body(enc)  # indices [6, 7, 6, 7], codes (1 byte), magnitudes (4 floats)
    assert decode(enc, raw)[[6, 7, 14, 15]].tolist() == [7, 8, 15, 16]
    for bad, match in ((_hostile(raw, 4, np.array([7, 6], "<u2").tobytes()), "chunk 1: indices must be strictly"),
                       (_hostile(raw, 0, np.array([6, 6], "<u2").tobytes()), "chunk 0: indices must be strictly"),
                       (_hostile(raw, 2, np.array([8], "<u2").tobytes()), "chunk 0: .*below 8"),
                       (_hostile(raw, 9 + 8, np.array([-1.0], "<f4").tobytes()), "chunk 1: a negative magnitude"),
                       (_hostile(raw, 9, np.array([np.inf], "<f4").tobytes()), "NaN/Inf")):
        with pytest.raises(ProtocolError, match=match):
            decode(enc, bad)


def test_a_short_last_chunk_is_checked_against_its_own_length():
    x = np.arange(1, 11, dtype=np.float32)  # chunks of 8 and 2
    enc = TensorEncoder("d", x, codec="sparse", block=8, topk=3)
    raw = body(enc)  # indices [5, 6, 7] then [0, 1]
    assert decode(enc, raw)[8:].tolist() == [9, 10]
    with pytest.raises(ProtocolError, match="chunk 1: .*below 2"):
        decode(enc, _hostile(raw, 6, np.array([0, 2], "<u2").tobytes()))


def test_decoding_into_out_clears_what_was_there():
    x = np.arange(1, 9, dtype=np.float32)
    enc = TensorEncoder("d", x, codec="sparse", block=4, topk=1)
    out = np.full(8, 7.0, np.float32)
    dec = TensorDecoder(enc.header(1), DEFAULT_LIMITS, out=out)
    dec.write(body(enc))
    assert dec.finish().array.tolist() == [0, 0, 0, 4, 0, 0, 0, 8] and dec.memory_bytes == 4 + 1 + 16
