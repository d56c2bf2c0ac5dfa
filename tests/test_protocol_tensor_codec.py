"""Tensor codec: exact round trips, error bounds, chunked receive and hostile headers."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import DEFAULT_LIMITS, WireLimits
from protocol.schema import DEFAULT_REGISTRY, TensorHeader
from protocol.tensor_codec import DTYPES, MAX_NDIM, tensor_nbytes
from protocol.tensor_decoder import DecodedTensor, TensorDecoder
from protocol.tensor_encoder import TensorEncoder

LIMITS = DEFAULT_LIMITS
NUMPY_DTYPES = [name for name in DTYPES if name != "bfloat16"]
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def send(encoder: TensorEncoder, *, stream: int = 1, limits=LIMITS, **kw) -> DecodedTensor:
    """Header through the message registry, body through slot/advance, like the transport."""
    header = DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(encoder.header(stream)), limits).message
    decoder = TensorDecoder(header, limits, **kw)
    for chunk in encoder.chunks():
        assert len(chunk) <= encoder.chunk_size
        decoder.slot(len(chunk))[:] = chunk
        decoder.advance(len(chunk))
    assert decoder.done
    return decoder.finish()


def header(**changes) -> TensorHeader:
    fields = dict(stream=1, name="w", dtype="float32", shape=[2, 3], codec="raw", nbytes=24, block=0)
    fields.update(changes)
    return TensorHeader(**fields)


def bound_q8(x: np.ndarray, block: int) -> np.ndarray:
    """The documented per-element q8 bound, absmax(block)/254, with float32 rounding slack."""
    flat = np.abs(x.reshape(-1).astype(np.float64))
    absmax = np.maximum.reduceat(flat, np.arange(0, flat.size, block))
    return np.repeat(absmax, block)[: flat.size] / 254 * (1 + 1e-4) + 2.0**-140


def error(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.reshape(-1).astype(np.float64) - b.reshape(-1).astype(np.float64))


shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


# --- raw ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_raw_round_trip_is_bit_exact(dtype, data):
    array = data.draw(hnp.arrays(DTYPES[dtype], shapes))
    chunk_size = data.draw(st.integers(1, 64))
    out = send(TensorEncoder("w", array, chunk_size=chunk_size), allow_nonfinite=True)
    assert out.dtype == dtype and out.array.shape == array.shape and out.array.dtype == DTYPES[dtype]
    assert out.array.tobytes() == array.tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_raw_round_trip_from_torch_is_bit_exact(dtype):
    t = (torch.randn(5, 7) * 100).to(TORCH_DTYPES[dtype])
    back = send(TensorEncoder("w", t, chunk_size=13)).to_torch()
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_bfloat16_nonfinite_round_trip_and_rejection():
    t = torch.tensor([1.0, float("inf"), float("nan"), -3.5], dtype=torch.bfloat16)
    back = send(TensorEncoder("b", t), allow_nonfinite=True).to_torch()
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))
    with pytest.raises(ProtocolError, match="tensor 'b' contains NaN/Inf"):
        send(TensorEncoder("b", t))


def test_raw_chunks_are_zero_copy_views():
    array = np.arange(10_000, dtype=np.float32)
    chunks = list(TensorEncoder("w", array, chunk_size=4096).chunks())
    assert len(chunks) == 10 and all(len(c) <= 4096 for c in chunks)
    assert all(np.shares_memory(np.frombuffer(c, np.uint8), array) for c in chunks)
    t = torch.arange(1000, dtype=torch.float32)
    (first,) = TensorEncoder("t", t).chunks()
    assert np.frombuffer(first, np.uint8).ctypes.data == t.data_ptr()


def test_non_contiguous_input_is_made_contiguous():
    array = np.arange(60, dtype=np.int32).reshape(6, 10)[::2, 1::3]
    assert send(TensorEncoder("w", array, chunk_size=7)).array.tolist() == array.tolist()
    t = torch.arange(60, dtype=torch.int64).reshape(6, 10).t()
    assert torch.equal(send(TensorEncoder("t", t)).to_torch(), t)


def test_torch_input_that_requires_grad():
    t = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(send(TensorEncoder("t", t)).to_torch(), t.detach())


def test_zero_size_and_scalar_tensors():
    for codec in ("raw", "float16", "q8"):
        empty = np.zeros((0, 5), np.float32)
        enc = TensorEncoder("e", empty, codec=codec)
        assert enc.nbytes == 0 and list(enc.chunks()) == []
        assert send(enc).array.shape == (0, 5)
    scalar = send(TensorEncoder("s", np.float64(2.5))).array
    assert scalar.shape == () and scalar == 2.5
    assert send(TensorEncoder("s", torch.tensor(7, dtype=torch.int8))).to_torch().item() == 7


def test_unsupported_inputs_are_refused_locally():
    with pytest.raises(ValueError, match="unsupported dtype 'complex64'"):
        TensorEncoder("w", np.zeros(3, np.complex64))
    with pytest.raises(ValueError, match="unsupported dtype 'bool'"):
        TensorEncoder("w", torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs a float dtype"):
        TensorEncoder("w", np.zeros(3, np.int32), codec="q8")
    with pytest.raises(ValueError, match="unknown codec"):
        TensorEncoder("w", np.zeros(3, np.float32), codec="zstd")
    with pytest.raises(TypeError):
        TensorEncoder("w", [1.0, 2.0])
    with pytest.raises(ValueError, match="chunk_size"):
        TensorEncoder("w", np.zeros(3, np.float32), chunk_size=0)
    with pytest.raises(ValueError, match="stream"):
        TensorEncoder("w", np.zeros(3, np.float32)).header(2**32)


# --- lossy codecs ---------------------------------------------------------------------

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
float_arrays = st.one_of(
    hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=40), elements=finite32),
    hnp.arrays(np.float64, hnp.array_shapes(max_dims=2, max_side=40),
               elements=st.floats(-1e38, 1e38, allow_nan=False)),
    # mixed scales in one tensor: each block only answers for its own absmax
    st.builds(lambda base, exp: (base * 10.0 ** exp).astype(np.float32),
              hnp.arrays(np.float32, 257, elements=st.floats(-1, 1, width=32)),
              st.sampled_from([-40, -30, -10, 0, 10, 30, 38])),
    hnp.arrays(np.float32, st.integers(0, 50), elements=st.just(0.0)),
)


@given(array=float_arrays, block=st.integers(1, 96), chunk_size=st.integers(1, 700))
@settings(max_examples=100, deadline=None)
def test_q8_error_is_within_absmax_over_254(array, block, chunk_size):
    enc = TensorEncoder("w", array, codec="q8", block=block, chunk_size=chunk_size)
    assert enc.nbytes == array.size + 4 * -(-array.size // block)
    out = send(enc)
    assert out.array.dtype == array.dtype and out.array.shape == array.shape
    assert (error(array, out.array) <= bound_q8(array, block)).all()


def test_q8_body_layout_is_int8_values_then_float32_scales():
    array = np.array([127.0, -127.0, 63.0, 0.0, 254.0, 2.0], np.float32)
    body = b"".join(bytes(c) for c in TensorEncoder("w", array, codec="q8", block=4).chunks())
    assert np.frombuffer(body[:6], np.int8).tolist() == [127, -127, 63, 0, 127, 1]
    assert np.frombuffer(body[6:], np.float32).tolist() == [1.0, 2.0]


def test_q8_extremes():
    fmax = np.finfo(np.float32).max
    array = np.array([fmax, -fmax, 1.0, 0.0, 1e-45, -1e-45, 3e-39, 0.0], np.float32)
    out = send(TensorEncoder("w", array, codec="q8", block=2)).array
    assert np.isfinite(out).all()
    assert (error(array, out) <= bound_q8(array, 2)).all()
    half = np.array([65504, -65504, 1], np.float16)
    assert np.isfinite(send(TensorEncoder("h", half, codec="q8")).array).all()
    with pytest.raises(ValueError, match="float32 scale range"):
        list(TensorEncoder("d", np.array([1e300]), codec="q8").chunks())


def test_q8_nonfinite_poisons_only_its_block():
    array = np.array([1.0, np.nan, 2.0, 3.0, np.inf, 4.0], np.float32)
    out = send(TensorEncoder("w", array, codec="q8", block=2), allow_nonfinite=True).array
    assert np.isnan(out[[0, 1, 4, 5]]).all()
    assert np.allclose(out[2:4], [2.0, 3.0], atol=3 / 254)
    with pytest.raises(ProtocolError, match="NaN/Inf"):
        send(TensorEncoder("w", array, codec="q8", block=2))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_q8_and_float16_from_torch_keep_the_dtype(dtype):
    t = (torch.randn(1000) * 5).to(TORCH_DTYPES[dtype])
    ref = t.double().numpy()
    for codec, tol in (("q8", None), ("float16", 2.0**-11)):
        back = send(TensorEncoder("t", t, codec=codec, block=64, chunk_size=300)).to_torch()
        assert back.dtype == t.dtype and back.shape == t.shape
        err = error(ref, back.double().numpy())
        if tol is None:
            bound = bound_q8(ref, 64) + (np.abs(ref) * 2.0**-8 if dtype == "bfloat16" else 0)
            if dtype == "float16":
                bound = bound + np.abs(ref) * 2.0**-11
        else:
            bound = np.abs(ref) * (2.0**-8 if dtype == "bfloat16" else tol) + 2.0**-25
        assert (err <= bound).all()


@given(array=hnp.arrays(np.float32, st.integers(0, 400), elements=st.floats(-65504, 65504, width=32)),
       chunk_size=st.integers(1, 500))
@settings(max_examples=60, deadline=None)
def test_float16_error_bound(array, chunk_size):
    enc = TensorEncoder("w", array, codec="float16", chunk_size=chunk_size)
    assert enc.nbytes == 2 * array.size
    out = send(enc).array
    assert out.dtype == np.float32
    assert (error(array, out) <= np.abs(array.astype(np.float64)) * 2.0**-11 + 2.0**-25).all()


def test_float16_saturates_instead_of_overflowing():
    array = np.array([1e6, -1e6, 70000.0, np.inf, 1.0], np.float64)
    out = send(TensorEncoder("w", array, codec="float16"), allow_nonfinite=True).array
    assert out.tolist() == [65504.0, -65504.0, 65504.0, np.inf, 1.0]


# --- receiving --------------------------------------------------------------------


@given(
    codec_dtype=st.sampled_from([("raw", "int64"), ("raw", "bfloat16"), ("float16", "float32"),
                                 ("float16", "bfloat16"), ("q8", "float32"), ("q8", "float64")]),
    n=st.integers(0, 300),
    cuts=st.lists(st.integers(0, 64), max_size=80),
    block=st.integers(1, 40),
)
@settings(max_examples=80, deadline=None)
def test_body_can_arrive_in_pieces_of_any_size(codec_dtype, n, cuts, block):
    codec, dtype = codec_dtype
    t = (torch.randn(n) * 50).to(TORCH_DTYPES[dtype])
    enc = TensorEncoder("w", t, codec=codec, block=block)
    body = b"".join(bytes(c) for c in enc.chunks())
    decoder = TensorDecoder(enc.header(1), LIMITS)
    pos = 0
    for cut in cuts + [len(body)]:
        size = min(cut, len(body) - pos)
        view = decoder.slot(size)
        assert len(view) == size
        view[:] = body[pos : pos + size]
        decoder.advance(size)
        pos += size
    assert decoder.done and decoder.received == len(body) and decoder.remaining == 0
    got, expected = decoder.finish().array, send(enc).array
    assert got.shape == expected.shape == (n,) and got.tobytes() == expected.tobytes()


def test_partial_advance_and_write():
    array = np.arange(10, dtype=np.float32)
    data = array.tobytes()
    decoder = TensorDecoder(header(shape=[10], nbytes=40), LIMITS)
    decoder.slot(16)[:12] = data[:12]
    decoder.advance(12)  # fewer bytes than the slot offered
    decoder.write(bytearray(data[12:30]))
    decoder.write(memoryview(np.frombuffer(data[30:], np.uint16)))  # non-byte format is fine
    assert decoder.finish().array.tolist() == array.tolist()
    assert decoder.finish() is decoder.finish()


def test_slot_and_advance_misuse_is_a_local_error():
    decoder = TensorDecoder(header(), LIMITS)
    with pytest.raises(ValueError):
        decoder.advance(4)  # no slot first
    decoder.slot(4)
    with pytest.raises(ValueError):
        decoder.advance(5)  # more than the slot
    with pytest.raises(ValueError):
        decoder.slot(-1)


def test_more_body_than_declared_is_refused():
    decoder = TensorDecoder(header(), LIMITS)
    decoder.write(bytes(20))
    with pytest.raises(ProtocolError, match="longer than the 24 bytes declared"):
        decoder.slot(5)
    decoder.write(bytes(4))
    with pytest.raises(ProtocolError, match="longer"):
        decoder.write(b"x")


def test_incomplete_body_is_refused():
    decoder = TensorDecoder(header(), LIMITS)
    decoder.write(bytes(10))
    assert not decoder.done
    with pytest.raises(ProtocolError, match="incomplete, 10 of 24"):
        decoder.finish()


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"dtype": "complex64"}, ProtocolError, "tensor 'w': unsupported dtype 'complex64'"),
        ({"dtype": "object"}, ProtocolError, "unsupported dtype"),
        ({"codec": "zstd"}, ProtocolError, "unknown codec 'zstd'"),
        ({"dtype": "int32", "codec": "q8", "block": 4, "nbytes": 10}, ProtocolError, "needs a float dtype"),
        ({"dtype": "uint8", "codec": "float16", "nbytes": 12}, ProtocolError, "needs a float dtype"),
        ({"nbytes": 25}, ProtocolError, "header says 25 body bytes"),
        ({"nbytes": (1 << 20) + 4}, ProtocolError, "body bytes"),
        ({"nbytes": 0}, ProtocolError, "header says 0 body bytes"),
        ({"shape": [1024, 256, -3]}, ProtocolError, "bad dimension -3"),
        ({"shape": [4] * (MAX_NDIM + 1), "nbytes": 1 << 20}, ProtocolError, "more than 8"),
        ({"codec": "q8", "block": 0, "nbytes": 10}, ProtocolError, "q8 block"),
        ({"codec": "q8", "block": 2**40, "nbytes": 10}, ProtocolError, "q8 block"),
        ({"block": 4}, ProtocolError, "block must be 0"),
        ({"stream": 2**32}, ProtocolError, "stream"),
        ({"shape": [2**20, 2**20, 2**20], "nbytes": 4 * 2**60}, LimitExceeded, "max_tensor_bytes"),
        ({"shape": [0, 2**62, 4], "nbytes": 0}, LimitExceeded, "absurdly large"),
        ({"shape": [2**31 + 1], "nbytes": 2**33 + 4}, LimitExceeded, "max_tensor_bytes"),
    ],
)
def test_bad_headers_are_refused_before_allocating(changes, error, match):
    # On a 1 MiB tensor, so that allocating the array before a check (the bug this guards) would show.
    base = dict(shape=[512, 512], nbytes=1 << 20)
    if "shape" in changes:
        base = {}
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            TensorDecoder(header(**{**base, **changes}), LIMITS)
        allocated = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert allocated < 64 * 1024, f"{allocated} bytes allocated while refusing the header"


def test_limits_bound_decoded_and_body_size():
    small = WireLimits(max_tensor_bytes=100)
    TensorDecoder(header(shape=[25], nbytes=100), small)
    with pytest.raises(LimitExceeded):
        TensorDecoder(header(shape=[26], nbytes=104), small)
    # float16 on the wire is small, but it decodes to float64: the decoded size counts
    with pytest.raises(LimitExceeded, match="decoded"):
        TensorDecoder(header(dtype="float64", shape=[20], codec="float16", nbytes=40), small)


def test_decoder_reports_what_it_allocated():
    d = TensorDecoder(header(shape=[1000], codec="q8", block=100, nbytes=1040), LIMITS)
    assert d.memory_bytes == 4000 + 40
    assert TensorDecoder(header(), LIMITS, out=np.empty((2, 3), np.float32)).memory_bytes == 0


def test_tensor_nbytes():
    assert tensor_nbytes("float32", [2, 3]) == 24
    assert tensor_nbytes("bfloat16", [2, 3], "raw") == 12
    assert tensor_nbytes("float64", [10], "float16") == 20
    assert tensor_nbytes("float32", [10], "q8", 4) == 10 + 4 * 3
    assert tensor_nbytes("int8", []) == 1
    with pytest.raises(ValueError):
        tensor_nbytes("float32", [-1])


# --- out= ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "float16", "q8"])
def test_decode_into_preallocated_out(codec):
    array = np.linspace(-3, 3, 1000, dtype=np.float32).reshape(10, 100)
    out = np.full((10, 100), 99.0, np.float32)
    result = send(TensorEncoder("w", array, codec=codec, chunk_size=333), out=out)
    assert result.array is out
    assert np.allclose(out, array, atol=3 / 254 + 1e-6)


def test_raw_is_received_straight_into_out():
    out = np.zeros(8, np.int64)
    decoder = TensorDecoder(header(dtype="int64", shape=[8], nbytes=64), LIMITS, out=out)
    view = decoder.slot(64)
    assert np.shares_memory(np.frombuffer(view, np.uint8), out)


def test_out_can_be_a_torch_tensor_including_bfloat16():
    src = torch.randn(4, 5).to(torch.bfloat16)
    dst = torch.zeros(4, 5, dtype=torch.bfloat16)
    enc = TensorEncoder("w", src)
    decoder = TensorDecoder(enc.header(1), LIMITS, out=dst)
    for chunk in enc.chunks():
        decoder.write(chunk)
    decoder.finish()
    assert torch.equal(dst, src)


def test_out_mismatch_is_refused():
    with pytest.raises(ProtocolError, match="shape"):
        TensorDecoder(header(), LIMITS, out=np.empty((3, 2), np.float32))
    with pytest.raises(ProtocolError, match="dtype"):
        TensorDecoder(header(), LIMITS, out=np.empty((2, 3), np.float64))
    with pytest.raises(ProtocolError, match="dtype"):
        TensorDecoder(header(), LIMITS, out=torch.empty(2, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="contiguous"):
        TensorDecoder(header(), LIMITS, out=np.empty((3, 2), np.float32).T)


# --- non-finite values ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_values_are_refused_unless_allowed(dtype, bad):
    array = np.ones(5000, DTYPES[dtype])
    array[4321] = bad
    with pytest.raises(ProtocolError, match="tensor 'w' contains NaN/Inf"):
        send(TensorEncoder("w", array))
    out = send(TensorEncoder("w", array), allow_nonfinite=True).array
    assert out.tobytes() == array.tobytes()
    # integers have no NaN: nothing to check
    send(TensorEncoder("i", np.full(4, -1, np.int32)))
