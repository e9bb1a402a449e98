"""The int8 Triton kernels against the torch reference, under the Triton interpreter.

Tolerance: none. The kernels do the reference's arithmetic (fp32, correctly rounded division,
round half to even), so codes, scales and decoded values must match bit for bit.
"""

import pytest
import torch

from ccfx.codecs.int8 import int8_decode_reference, int8_encode_reference
from tests._triton_interp import kernels

K = kernels("int8")

SHAPES = [(257, 33), (1,), (0,), (5, 0, 3), ()]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(x, block):
    q, s = K.int8_encode(x, block)
    rq, rs = int8_encode_reference.eager(x, block)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q, rq)
    y = K.int8_decode(q, s, block, x.shape, x.dtype)
    ry = int8_decode_reference.eager(rq, rs, block, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    torch.manual_seed(0)
    _check(torch.randn(shape).mul(3).to(dtype), 256)


@pytest.mark.parametrize("block", [1, 7, 64, 100, 1000])
def test_block_sizes(block):
    torch.manual_seed(1)
    _check(torch.randn(257, 33), block)


def test_noncontiguous_and_ties():
    x = torch.randn(40, 30).t()  # non-contiguous
    _check(x, 64)
    # Exact halves between codes: round half to even on both sides.
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 63.5, -64.5])
    _check(ties, 8)


def test_nonfinite_blocks_decode_to_nan():
    x = torch.randn(300)
    x[3] = float("nan")
    x[270] = float("inf")
    _check(x, 256)
    q, s = K.int8_encode(x, 256)
    y = K.int8_decode(q, s, 256, x.shape, x.dtype)
    assert torch.isnan(y).all()  # both blocks hold a non-finite value


def test_zero_block():
    _check(torch.zeros(300), 128)
