"""The threshold selection kernels against the torch reference, under the Triton interpreter.

Tolerance: none on the kept set. ``count``, and the (value, index) pairs slot by slot, must equal
``threshold_encode_reference``'s, up to the order of entries of equal magnitude: torch.topk
leaves that order unspecified, the kernel gives ascending index (checked), so both sides are
compared in the canonical order (magnitude descending, then index ascending).
"""

import pytest
import torch

from ccfx.codecs import _sparse
from ccfx.codecs.threshold import threshold_encode_compact, threshold_encode_reference
from tests._triton_interp import kernels

K = kernels("threshold")

SHAPES = [(257, 33), (1,), (0,), ()]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _canonical(values, idx, count):
    c = int(count)
    v, i = values[:c], idx[:c]
    order = torch.sort(i, stable=True).indices
    v, i = v[order], i[order]
    order = torch.sort(_sparse.magnitude(v), descending=True, stable=True).indices
    return torch.cat([v[order], values[c:]]), torch.cat([i[order], idx[c:]])


def _check(x, tau, cap):
    capacity = _sparse.count(x.numel(), cap)
    v, i, c = K.threshold_encode(x, tau, capacity)
    rv, ri, rc = threshold_encode_reference(x, tau, capacity)
    assert v.dtype == x.dtype and i.dtype == torch.int32 and c.dtype == torch.int32
    assert v.shape == rv.shape and i.shape == ri.shape and c.shape == (1,)
    assert torch.equal(c, rc)
    cv, ci = _canonical(v, i, c)
    assert torch.equal(ci, i), "kernel output is not in canonical order"
    torch.testing.assert_close(cv, v, rtol=0, atol=0, equal_nan=True)
    rv, ri = _canonical(rv, ri, rc)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=0, atol=0, equal_nan=True)
    return int(c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).mul(3).to(dtype)
    _check(x, 6.0, 0.1)  # about 5% pass: under capacity
    _check(x, 0.0, 1.0)  # everything nonzero passes


def test_tau_rounded_to_input_dtype():
    # 0.01 is 0.010002136 in fp16: an fp16 0.010002136 does not pass, as in torch.
    x = torch.tensor([0.01, 0.0101, -0.02, 0.009], dtype=torch.float16)
    assert _check(x, 0.01, 1.0) == 2


def test_nonfinite_and_ties():
    x = torch.zeros(3000)
    x[[5, 2999, 1500, 17]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.0])
    x[[100, 200, 300]] = torch.tensor([-2.0, 2.0, 1.5])  # ties with x[17]
    assert _check(x, 1.0, 0.01) == 7
    assert _check(x[::2], 1.0, 0.01) == 4  # non-contiguous: the odd indices (5, 2999, 17) drop
    # tau rounding to inf (fp16): NaN as +inf does not pass inf, as in the reference.
    assert _check(x.half(), 1e6, 0.01) == 0


def test_overflow_keeps_the_largest():
    torch.manual_seed(2)
    x = torch.randn(257, 33)
    assert _check(x, 0.1, 0.01) == _sparse.count(x.numel(), 0.01)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_compaction_is_the_kernels_payload(dtype):
    """The CPU path (``threshold_encode_compact``) and the kernel agree slot for slot, ties
    included: both compact in index order, then sort stably by magnitude."""
    torch.manual_seed(3)
    x = torch.randn(257, 33).mul(3).round().to(dtype)  # ties everywhere
    x[0, [4, 9]] = torch.tensor([float("nan"), -float("inf")], dtype=dtype)
    capacity = _sparse.count(x.numel(), 0.2)
    for tau in (5.0, 1e6):
        with torch.device("cpu"):  # the CPU path even where x is on CUDA (CCFX_TEST_DEVICE)
            got = threshold_encode_compact(x.cpu(), tau, capacity)
        for a, b in zip(got, K.threshold_encode(x, tau, capacity), strict=True):
            torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0, equal_nan=True)


def test_codec_dispatches_to_triton_on_cuda():
    """No GPU here: the codec picks this launcher for CUDA tensors, the reference otherwise."""
    from types import SimpleNamespace

    from ccfx import codecs

    codec = codecs.get("threshold")
    assert codec._impl(SimpleNamespace(is_cuda=True)) is K.threshold_encode
    assert codec._impl(SimpleNamespace(is_cuda=False)) is threshold_encode_reference
