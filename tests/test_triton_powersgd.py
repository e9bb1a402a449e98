"""PowerSGD's batched Gram-Schmidt kernel against the torch reference, under the Triton
interpreter.

Tolerance: fp32, ``atol=rtol=1e-5`` against ``gram_schmidt`` on well-conditioned input (the
kernel takes its dot products before normalising and sums in another order, so rounding
differs); fp16/bf16 input is orthogonalised in fp32 and rounded back, so it is compared with the
reference on the fp32 upcast, rounded the same way, to one ulp of the dtype. Against QR (the CPU
reference's choice for r > 2) the columns agree up to sign.
"""

import pytest
import torch

from ccfx.codecs import implementation
from ccfx.codecs.powersgd import gram_schmidt, orthogonalize
from tests._triton_interp import kernels

K = kernels("powersgd")

SHAPES = [(3, 257, 4), (1, 1), (2, 5, 2), (4, 33, 1), (0, 10, 3), (2, 0, 3)]
DTYPES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# 257 x 33 (33 columns: 132 row sweeps, slow under the interpreter) in fp32 only.
CASES = [(s, d) for s in SHAPES for d in DTYPES] + [((257, 33), torch.float32)]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_matches_reference(shape, dtype):
    torch.manual_seed(0)
    p = torch.randn(shape).to(dtype)
    q = K.gram_schmidt(p)
    assert q.shape == p.shape and q.dtype == p.dtype
    ref = gram_schmidt(p.float()).to(dtype)
    tol = DTYPES[dtype]
    torch.testing.assert_close(q, ref, rtol=tol, atol=tol)
    if dtype == torch.float32 and p.numel():
        eye = torch.eye(shape[-1]).expand(*shape[:-2], -1, -1)
        torch.testing.assert_close(q.mT @ q, eye, rtol=0, atol=1e-5)


def test_noncontiguous_and_batched_dims():
    torch.manual_seed(1)
    p = torch.randn(2, 3, 4, 40).mT  # [2, 3, 40, 4], non-contiguous
    torch.testing.assert_close(K.gram_schmidt(p), gram_schmidt(p), rtol=1e-5, atol=1e-5)


def test_qr_columns_up_to_sign():
    torch.manual_seed(2)
    p = torch.randn(5, 257, 4)
    with implementation("reference"):  # on CUDA tensors too (CCFX_TEST_DEVICE=cuda)
        qr = orthogonalize(p)  # r > 2: torch.linalg.qr
    q = K.gram_schmidt(p)
    sign = torch.sign((q * qr).sum(dim=-2, keepdim=True))
    torch.testing.assert_close(q * sign, qr, rtol=1e-5, atol=1e-5)


def test_zero_and_dependent_columns():
    torch.manual_seed(3)
    a, b = torch.randn(50, 1), torch.randn(50, 1)
    p = torch.cat([a, torch.zeros(50, 1), 2 * a, b, a - 3 * b], dim=1)
    q = K.gram_schmidt(p)
    assert torch.isfinite(q).all()
    assert torch.equal(q[:, 1], torch.zeros(50))  # a zero column stays zero
    # The span is kept: projecting the input onto the result reproduces it.
    torch.testing.assert_close(q @ (q.T @ p), p, rtol=1e-5, atol=1e-5)
    assert torch.equal(K.gram_schmidt(torch.zeros(2, 7, 3)), torch.zeros(2, 7, 3))


def test_nan_propagates():
    p = torch.randn(10, 2)
    p[3, 0] = float("nan")
    assert torch.isnan(K.gram_schmidt(p)).any()


def test_codec_dispatches_to_triton_on_cuda():
    """No GPU here: ``orthogonalize`` picks the kernel for CUDA tensors, the reference
    otherwise (QR for r > 2, Gram-Schmidt for r <= 2)."""
    from types import SimpleNamespace

    from ccfx.codecs import powersgd

    assert powersgd._orth_impl(SimpleNamespace(is_cuda=True, shape=(9, 4))) is K.gram_schmidt
    assert powersgd._orth_impl(SimpleNamespace(is_cuda=False, shape=(9, 2))) is gram_schmidt
