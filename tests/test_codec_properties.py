"""Property tests (hypothesis): each codec keeps the promise its docstring makes, for any
shape (0-d, empty, odd), magnitudes from 1e-30 to 1e30, and contiguous or not."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ccfx import codecs
from ccfx.codecs.base import blocked

FAST = settings(max_examples=30, deadline=None)
SLOW = settings(max_examples=8, deadline=None)


@st.composite
def tensors(draw, max_dims=3, max_side=40, min_numel=0):
    shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims)))
    if math.prod(shape) < min_numel:
        shape = (min_numel,)
    scale = 10.0 ** draw(st.integers(-30, 30))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=g) * scale
    if len(shape) >= 2 and draw(st.booleans()):
        x = x.transpose(0, 1)  # non-contiguous
    return x


def _block_absmax(x, block):
    rows = blocked(x.reshape(-1).float(), block)
    return rows.abs().amax(dim=1, keepdim=True).expand_as(rows).reshape(-1)[: x.numel()]


@FAST
@given(tensors(), st.sampled_from([1, 7, 64, 256]))
def test_int8_error_at_most_half_a_step(x, block):
    y = codecs.get(f"int8:block={block}").roundtrip(x)
    step = _block_absmax(x, block) / 127
    err = (y - x).reshape(-1).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-6 * x.reshape(-1).abs()).all()


@FAST
@given(tensors(), st.sampled_from([1, 33, 256]))
def test_int4_error_at_most_half_a_step(x, block):
    y = codecs.get(f"int4:block={block}").roundtrip(x)
    step = _block_absmax(x, block) / 7
    err = (y - x).reshape(-1).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-6 * x.reshape(-1).abs()).all()


@FAST
@given(tensors(), st.sampled_from([("e4m3", 2**-4, 2**-10, 448.0), ("e5m2", 2**-3, 2**-17, 57344.0)]))
def test_fp8_relative_error(x, fmt):
    """Half an ulp of the format, relative, down to its smallest subnormal (absolute)."""
    name, rel, sub, fmax = fmt
    y = codecs.get(f"fp8:fmt={name}").roundtrip(x)
    scale = _block_absmax(x, 256) / fmax
    err = (y - x).reshape(-1).abs()
    bound = rel * x.reshape(-1).abs() * (1 + 1e-5) + sub * scale * (1 + 1e-5)
    assert (err <= bound).all()


@FAST
@given(tensors(min_numel=1), st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_topk_keeps_the_largest_exactly(x, ratio):
    codec = codecs.get(f"topk:ratio={ratio}")
    enc = codec.encode(x)
    values, idx = enc.payload
    flat = x.reshape(-1)
    assert torch.equal(values, flat[idx.long()])  # kept entries exact
    y = codec.decode(enc).reshape(-1)
    assert torch.equal(y[idx.long()], flat[idx.long()])
    dropped = torch.ones_like(flat, dtype=torch.bool)
    dropped[idx.long()] = False
    assert (y[dropped] == 0).all()
    if dropped.any():
        assert flat[idx.long()].abs().min() >= flat[dropped].abs().max()


@FAST
@given(tensors(min_numel=1), st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.05, 1.0]))
def test_threshold_keeps_what_passes_up_to_capacity(x, tau_scale, cap):
    scale = x.abs().max().item()
    tau = tau_scale * scale
    codec = codecs.get(f"threshold:tau={tau},cap={cap}")
    enc = codec.encode(x)
    count = int(enc.payload[2])
    passing = int((x.abs() > tau).sum())
    assert count == min(passing, enc.payload[0].numel())
    y = codec.decode(enc)
    kept = y != 0
    assert torch.equal(y[kept], x[kept])
    if passing <= enc.payload[0].numel():
        assert torch.equal(kept, (x.abs() > tau) & (x != 0))


@FAST
@given(tensors(min_numel=1), st.sampled_from([0.01, 0.3, 1.0]), st.integers(0, 5))
def test_randomk_sends_k_distinct_entries_exactly(x, ratio, seed):
    codec = codecs.get(f"randomk:ratio={ratio},seed={seed}")
    flat = x.reshape(-1)
    y = codec.roundtrip(x).reshape(-1)
    k = codec.payload_layout(x.shape, x.dtype)[0][0][0]
    sampled = y != 0
    assert int(sampled.sum()) <= k  # (a sampled exact zero also reads as 0)
    assert torch.equal(y[sampled], flat[sampled])
    # Same seed and step on another object: the same indices (what ranks rely on).
    other = codecs.get(f"randomk:ratio={ratio},seed={seed}")
    assert torch.equal(other.roundtrip(x), y.view(x.shape))


@FAST
@given(tensors(min_numel=1), st.sampled_from([1, 5, 256]))
def test_sign_keeps_signs_and_block_mean_magnitude(x, block):
    y = codecs.get(f"sign:block={block}").roundtrip(x).reshape(-1)
    flat = x.reshape(-1)
    nonzero = flat != 0
    assert torch.equal(torch.sign(y[nonzero]), torch.sign(flat[nonzero]))
    rows = blocked(flat.abs(), block)
    counts = torch.clamp(flat.numel() - torch.arange(rows.shape[0]) * block, max=block)
    mean = (rows.sum(1) / counts).repeat_interleave(block)[: flat.numel()]
    torch.testing.assert_close(y.abs(), mean)


@FAST
@given(
    st.integers(2, 30), st.integers(2, 30), st.integers(1, 3), st.integers(0, 3),
    st.integers(0, 2**31),
)
def test_powersgd_exact_when_rank_covers_the_matrix(rows, cols, true_rank, extra, seed):
    rank = true_rank + extra
    if (rows + cols) * min(rank, rows, cols) >= rows * cols:
        rows, cols = rows + 30, cols + 30  # make low rank pay, so the P Qᵀ path runs
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, true_rank, generator=g) @ torch.randn(true_rank, cols, generator=g)
    y = codecs.get(f"powersgd:rank={rank}").roundtrip(m)
    assert (y - m).norm() <= 1e-4 * m.norm()


@SLOW
@given(tensors(max_dims=2, max_side=8, min_numel=1), st.sampled_from(["qsgd:levels=4,block=16",
       "qsgd", "terngrad:block=8"]))
def test_stochastic_codecs_are_unbiased(x, spec):
    x = x / x.abs().max()  # unit scale: the bound below is absolute
    codec = codecs.get(spec)
    trials = 400
    mean = sum(codec.roundtrip(x) for _ in range(trials)) / trials
    # Per-element variance <= (norm / levels)^2 / 4 for qsgd, <= s * |x| <= 1 for terngrad;
    # with |x| <= 1 and blocks of <= 256 elements both are <= 1: 6 sigma of the mean.
    assert ((mean - x).abs() <= 6 / math.sqrt(trials) + 1e-6).all()


@SLOW
@given(tensors(max_dims=2, max_side=20, min_numel=1), st.sampled_from(["topk:ratio=0.1",
       "sign", "int4", "randomk:ratio=0.2", "powersgd:rank=1", "terngrad"]))
def test_error_feedback_loses_nothing(x, inner):
    """Sum of decoded outputs + final residual == sum of inputs (the residual telescopes)."""
    x = x / x.abs().max()
    codec = codecs.get(inner + (",ef" if ":" in inner else ":ef"))
    xs = [x * (i + 1) for i in range(4)]
    sent = sum(codec.roundtrip(v) for v in xs)
    total = sum(xs)
    torch.testing.assert_close(sent + codec.state_dict()["residual"], total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["int8", "int8:block=16", "int4", "fp8", "sign", "qsgd",
                                  "qsgd:levels=1,block=16", "terngrad"])
def test_extreme_finite_values_stay_finite(spec):
    """An additive attention mask holds finfo.min: blockwise codecs must not round it into
    -inf (127 * (absmax / 127) can land one ulp past FLT_MAX), or the next softmax gives NaN.
    qsgd's L2 norm of such a block is past FLT_MAX itself."""
    big = torch.finfo(torch.float32).max
    x = torch.zeros(4, 300)
    x[:, 150:] = -big
    x[0, 3] = big
    y = codecs.get(spec).roundtrip(x)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qsgd_saturates_at_the_output_dtype(dtype):
    """Stochastic rounding can decode above the block's largest value; at the top of a half
    precision range that would cast to inf."""
    x = torch.full((4, 256), torch.finfo(dtype).max, dtype=dtype)
    x[1] = -x[1]
    codec = codecs.get("qsgd:levels=4")
    for _ in range(5):
        assert torch.isfinite(codec.roundtrip(x)).all()
