"""qsgd and terngrad Triton kernels against the torch references, under the Triton interpreter.

Tolerances: the counter-based noise is bit-exact (``_common.uniform`` == ``_random.uniform``);
terngrad's codes, scales and decoded values are bit-exact; qsgd's norms are block sums in
another order (rtol 1e-6), and given the same norms its levels and decoded values are
bit-exact.
"""

import pytest
import torch

from ccfx.codecs._random import key as noise_key
from ccfx.codecs._random import uniform as torch_uniform
from ccfx.codecs.qsgd import qsgd_decode_reference, qsgd_encode_reference
from ccfx.codecs.terngrad import terngrad_decode_reference, terngrad_encode_reference
from tests._triton_interp import kernels

COMMON = kernels("_common")
TG = kernels("terngrad")
QS = kernels("qsgd")

SHAPES = [(257, 33), (1,), (0,), ()]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, dtype):
    torch.manual_seed(0)
    return torch.randn(shape).mul(3).to(dtype)


def test_uniform_is_the_reference_hash_bit_for_bit():
    import triton
    import triton.language as tl

    @triton.jit
    def _draw(key_ptr, out_ptr, n, SIZE: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * SIZE + tl.arange(0, SIZE)
        tl.store(out_ptr + i, COMMON.uniform(i, key_ptr), mask=i < n)

    n = 5000
    index = torch.arange(n, dtype=torch.int64)
    for seed, step in [(0, 0), (1, 7), (2**40 + 3, 123456789)]:
        key = noise_key(seed, step)
        out = torch.empty(n)
        _draw[(triton.cdiv(n, 1024),)](key, out, n, SIZE=1024)
        assert torch.equal(out, torch_uniform(index, key))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [256, 7])
def test_terngrad(shape, dtype, block):
    x = _inputs(shape, dtype)
    key = noise_key(3, 5)
    codes, scales = TG.terngrad_encode(x, key, block)
    rcodes, rscales = terngrad_encode_reference.eager(x, key, block)
    assert torch.equal(codes, rcodes)
    torch.testing.assert_close(scales, rscales, rtol=0, atol=0, equal_nan=True)
    y = TG.terngrad_decode(codes, scales, block, x.shape, x.dtype)
    ry = terngrad_decode_reference.eager(rcodes, rscales, block, x.shape, x.dtype)
    torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block, levels, qdtype", [(256, 127, torch.int8), (7, 4, torch.int8),
                                                   (64, 1000, torch.int16)])
def test_qsgd(shape, dtype, block, levels, qdtype):
    x = _inputs(shape, dtype)
    key = noise_key(1, 2)
    q, norms = QS.qsgd_encode(x, key, block, levels, qdtype)
    rq, rnorms = qsgd_encode_reference.eager(x, key, block, levels, qdtype)
    torch.testing.assert_close(norms, rnorms, rtol=1e-6, atol=0, equal_nan=True)
    assert q.dtype == rq.dtype == qdtype and q.shape == rq.shape
    # Given the reference's norms, the levels are bit-exact.
    flat = x.reshape(-1).contiguous()
    assert torch.equal(QS.qsgd_levels(flat, rnorms, key, block, levels, qdtype), rq)
    # Different norms by an ulp may move a level by one, nowhere more.
    if q.numel():
        assert (q.int() - rq.int()).abs().max().item() <= 1
    y = QS.qsgd_decode(rq, rnorms, block, levels, x.shape, x.dtype)
    ry = qsgd_decode_reference.eager(rq, rnorms, block, levels, x.shape, x.dtype)
    torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)


def test_nonfinite_and_huge_blocks():
    big = torch.finfo(torch.float32).max
    x = torch.randn(600)
    x[5], x[300] = float("nan"), float("-inf")
    x[520:560] = -big  # an attention mask's finfo.min: must stay finite
    key = noise_key(0, 0)
    for enc, dec, ref_enc, ref_dec in [
        (lambda t: TG.terngrad_encode(t, key, 256),
         lambda p: TG.terngrad_decode(*p, 256, x.shape, x.dtype),
         lambda t: terngrad_encode_reference.eager(t, key, 256),
         lambda p: terngrad_decode_reference.eager(*p, 256, x.shape, x.dtype)),
        (lambda t: QS.qsgd_encode(t, key, 256, 127, torch.int8),
         lambda p: QS.qsgd_decode(*p, 256, 127, x.shape, x.dtype),
         lambda t: qsgd_encode_reference.eager(t, key, 256, 127, torch.int8),
         lambda p: qsgd_decode_reference.eager(*p, 256, 127, x.shape, x.dtype)),
    ]:
        y, ry = dec(enc(x)), ref_dec(ref_enc(x))
        assert y[:512].isnan().all() and ry[:512].isnan().all()
        assert torch.isfinite(y[512:]).all() and torch.isfinite(ry[512:]).all()
        torch.testing.assert_close(y, ry, rtol=1e-6, atol=0, equal_nan=True)
