"""int4 and sign Triton kernels against the torch references, under the Triton interpreter.

Tolerances: int4 codes, scales and decoded values are bit-exact (same fp32 arithmetic); sign
bits are exact and its scales (a block sum, summed in another order) agree to rtol 1e-6, so the
decoded values do too.
"""

import pytest
import torch

from ccfx.codecs.int4 import int4_decode_reference, int4_encode_reference
from ccfx.codecs.sign import sign_decode_reference, sign_encode_reference
from tests._triton_interp import kernels

I4 = kernels("int4")
SG = kernels("sign")

SHAPES = [(257, 33), (1,), (0,), ()]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, dtype):
    torch.manual_seed(0)
    return torch.randn(shape).mul(3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [256, 33])
def test_int4(shape, dtype, block):
    x = _inputs(shape, dtype)
    p, s = I4.int4_encode(x, block)
    rp, rs = int4_encode_reference.eager(x, block)
    assert torch.equal(p, rp)
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    y = I4.int4_decode(p, s, block, x.shape, x.dtype)
    ry = int4_decode_reference.eager(rp, rs, block, x.shape, x.dtype)
    torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [256, 5])
def test_sign(shape, dtype, block):
    x = _inputs(shape, dtype)
    b, s = SG.sign_encode(x, block)
    rb, rs = sign_encode_reference.eager(x, block)
    assert torch.equal(b, rb)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0, equal_nan=True)
    # The scales agree to a few fp32 ulps (sums in another order), which can move an fp16 or
    # bf16 output by one ulp; decoding the same scales must agree exactly.
    y = SG.sign_decode(b, s, block, x.shape, x.dtype)
    ry = sign_decode_reference.eager(rb, s, block, x.shape, x.dtype)
    torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)



def test_sign_of_zero_scale_decodes_to_signed_zeros():
    """A block of zeros has scale 0: its negative elements decode to -0.0, as the reference's
    ``-s`` gives (Triton 3.6 compiles a kernel's ``-s`` to ``0 - s``, which is +0.0)."""
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0, 0.0, 0.0, 0.0, 0.0, -0.0])
    b, s = SG.sign_encode(x, 4)
    s = torch.tensor([0.0, 0.0, 0.0])
    y = SG.sign_decode(b, s, 4, x.shape, x.dtype)
    ry = sign_decode_reference.eager(b, s, 4, x.shape, x.dtype)
    assert torch.equal(torch.signbit(y), torch.signbit(ry))
    assert torch.signbit(ry).tolist() == [True, False, True, False, False, False, False, False, False]

def test_nonfinite_blocks():
    x = torch.randn(600)
    x[5], x[300] = float("nan"), float("-inf")
    for enc, ref in [(lambda t: I4.int4_encode(t, 256), lambda t: int4_encode_reference.eager(t, 256)),
                     (lambda t: SG.sign_encode(t, 256), lambda t: sign_encode_reference.eager(t, 256))]:
        _, s = enc(x)
        _, rs = ref(x)
        assert torch.isnan(s[:2]).all() and torch.isfinite(s[2])
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0, equal_nan=True)
