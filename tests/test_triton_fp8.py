"""The fp8 Triton kernels against the torch reference, under the Triton interpreter.

Tolerance: none. The kernels do the reference's fp32 arithmetic (correctly rounded division) and
encode float8 with integer ops, round to nearest even, so codes, scales and decoded values must
match ``fp8_encode_reference`` / ``fp8_decode_reference`` bit for bit, for e4m3fn and e5m2. The
reference's own integer encoding is checked against torch's float8 casts here too.
"""

import pytest
import torch

from ccfx.codecs.fp8 import (
    FORMATS,
    fp8_bits,
    fp8_decode_reference,
    fp8_encode_reference,
    fp8_values,
)
from tests._triton_interp import kernels

K = kernels("fp8")

SHAPES = [(257, 33), (1,), (0,), (5, 0, 3), ()]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FMTS = list(FORMATS.values())


def _check(x, block, fmt):
    c, s = K.fp8_encode(x, block, fmt)
    rc, rs = fp8_encode_reference.eager(x, block, fmt)
    assert c.dtype == torch.uint8 and s.dtype == torch.float32
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(c, rc), (x.reshape(-1)[c != rc][:8], c[c != rc][:8], rc[c != rc][:8])
    y = K.fp8_decode(c, s, block, fmt, x.shape, x.dtype)
    ry = fp8_decode_reference.eager(rc, rs, block, fmt, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, fmt):
    torch.manual_seed(0)
    _check(torch.randn(shape).mul(3).to(dtype), 256, fmt)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block", [1, 7, 100])
def test_block_sizes(block, fmt):
    torch.manual_seed(1)
    _check(torch.randn(257, 33), block, fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_rounding_every_code_and_tie(fmt):
    """Every finite float8 value, every midpoint between neighbours (ties: to even), and points
    just off the midpoints, in one block whose absmax is fmax (so the scale is exactly 1)."""
    codes = torch.arange(256, dtype=torch.uint8)
    v = codes.view(fmt).float()
    v = v[torch.isfinite(v)].unique()  # sorted; -0.0 and 0.0 collapse
    mids = (v[1:] + v[:-1]) / 2  # exact in fp32
    off = mids.abs() * 2.0**-12
    x = torch.cat([v, mids, mids + off, mids - off, torch.tensor([-0.0, 2.0**-30, -(2.0**-30)])])
    _check(x, x.numel(), fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_matches_torch_float8_cast(fmt):
    """The reference's integer encoding and decoding against torch's own float8 casts: every
    code, every tie and its neighbours, random values over the whole range, all 256 codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    v = codes.view(fmt).float()
    v = v[torch.isfinite(v)].unique()
    mids = (v[1:] + v[:-1]) / 2
    fmax = torch.finfo(fmt).max
    rand = (torch.randn(20000) * torch.logspace(-12, 0, 20000) * fmax).clamp(-fmax, fmax)
    for y in [v, mids, mids * (1 + 2.0**-12), mids * (1 - 2.0**-12), rand, torch.tensor([-0.0])]:
        assert torch.equal(fp8_bits(y, fmt).to(torch.uint8), y.to(fmt).view(torch.uint8))
    torch.testing.assert_close(fp8_values(codes, fmt), codes.view(fmt).float(), rtol=0, atol=0,
                               equal_nan=True)
    # the sign of zeros and infinities; a NaN's sign bit is not kept by CUDA's cast
    ref = codes.view(fmt).float()
    keep = ~torch.isnan(ref)
    assert torch.equal(torch.signbit(fp8_values(codes, fmt))[keep], torch.signbit(ref)[keep])


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_all_codes(fmt):
    """All 256 bit patterns (NaN and inf codes included), scale 1."""
    codes = torch.arange(256, dtype=torch.uint8)
    y = K.fp8_decode(codes, torch.ones(1), 256, fmt, (256,), torch.float32)
    torch.testing.assert_close(y, codes.view(fmt).float(), rtol=0, atol=0, equal_nan=True)
    ref = codes.view(fmt).float()
    keep = ~torch.isnan(ref)  # a NaN's sign bit is not kept by CUDA's cast
    assert torch.equal(torch.signbit(y)[keep], torch.signbit(ref)[keep])


@pytest.mark.parametrize("fmt", FMTS)
def test_edge_blocks(fmt):
    x = torch.randn(40, 30).t()  # non-contiguous
    _check(x, 64, fmt)
    _check(torch.zeros(300), 128, fmt)  # zero blocks: scale 0, codes 0
    # Huge and tiny magnitudes (a subnormal fp32 scale), negative zeros.
    big = torch.tensor([3.0e38, -3.4e38, 1.0, -0.0, 1e-30, 1e-44, -1e-45, 0.0])
    _check(big, 4, fmt)
    x = torch.randn(300)
    x[3], x[270] = float("nan"), float("inf")
    _check(x, 256, fmt)
    c, s = K.fp8_encode(x, 256, fmt)
    assert torch.isnan(K.fp8_decode(c, s, 256, fmt, x.shape, x.dtype)).all()


def test_codec_dispatches_to_triton_on_cuda():
    """No GPU here: the codec picks these launchers for CUDA tensors, the references otherwise."""
    from types import SimpleNamespace

    from ccfx import codecs

    codec = codecs.get("fp8")
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert codec._impl(cuda, "encode") is K.fp8_encode
    assert codec._impl(cuda, "decode") is K.fp8_decode
    assert codec._impl(cpu, "encode") is fp8_encode_reference
    assert codec._impl(cpu, "decode") is fp8_decode_reference
