"""Every codec: exact wire bytes, shape and dtype kept, state semantics, non-finite input."""

import math

import pytest
import sympy
import torch

from ccfx import codecs
from ccfx.codecs import registry
from ccfx.errors import CodecError, ConfigError

SPECS = [
    "none", "fp16", "bf16", "fp8", "fp8:fmt=e5m2", "int8", "int8:block=7", "int4",
    "int4:block=33", "qsgd", "qsgd:levels=1000,block=16", "terngrad", "sign", "sign:block=5",
    "topk", "topk:ratio=0.3", "randomk:ratio=0.2", "threshold", "threshold:tau=0.5,cap=0.5",
    "powersgd", "powersgd:rank=1", "topk:ratio=0.1,ef", "powersgd:rank=2,ef", "int4:ef",
    "randomk:ef", "tlc", "tlc:sparsity=1.5,block=7", "tlc:ef", "redsync",
    "redsync:density=0.3,margin=1.5,ef",
]
SHAPES = [(257, 33), (1,), (0,), (), (3, 0, 2), (8, 9, 10), (1000,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def test_every_registered_codec_is_covered():
    assert {registry.parse_spec(s)[0] for s in SPECS} == set(codecs.names())


@pytest.mark.parametrize("spec", SPECS)
def test_wire_bytes_exact_and_shape_dtype_kept(spec):
    torch.manual_seed(0)
    for shape in SHAPES:
        for dtype in DTYPES:
            codec = codecs.get(spec)
            x = torch.randn(shape).to(dtype)
            enc = codec.encode(x)
            assert enc.nbytes == codec.wire_bytes(shape, dtype), (shape, dtype)
            layout = codec.payload_layout(shape, dtype)
            assert [(tuple(t.shape), t.dtype) for t in enc.payload] == [
                (tuple(s), d) for s, d in layout
            ]
            y = codec.decode(enc)
            assert y.shape == x.shape and y.dtype == x.dtype
            assert y.data_ptr() != x.data_ptr() or x.numel() == 0


@pytest.mark.parametrize("spec", SPECS)
def test_noncontiguous_input_same_as_contiguous(spec):
    x = torch.randn(40, 30).t()
    a, b = codecs.get(spec), codecs.get(spec)
    torch.testing.assert_close(a.roundtrip(x), b.roundtrip(x.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_symbolic_wire_bytes(spec):
    n, m = sympy.symbols("n m", positive=True, integer=True)
    codec = codecs.get(spec)
    expr = codec.wire_bytes((n, m), torch.float32)
    for nv, mv in [(257, 33), (64, 64), (1, 5)]:
        got = int(sympy.sympify(expr).subs({n: nv, m: mv}))
        assert got == codec.wire_bytes((nv, mv), torch.float32)


@pytest.mark.parametrize("spec", [s for s in SPECS if s not in ("none",)])
def test_nonfinite_input_propagates(spec):
    """A NaN or inf never decodes to a finite value where it stood (sparsifiers send them:
    they rank first), and the lossy quantizers poison their whole block."""
    codec = codecs.get(spec)
    x = torch.randn(64, 16)
    x[3, 4] = float("nan")
    x[40, 1] = float("inf")
    y = codec.roundtrip(x)
    if spec.startswith("randomk"):  # sampled positions only: whatever is sampled stays
        return
    assert not torch.isfinite(y[3, 4]) and not torch.isfinite(y[40, 1])


def test_fp16_overflow_becomes_inf():
    y = codecs.get("fp16").roundtrip(torch.tensor([1e6, -1e6, 1.0]))
    assert torch.isinf(y[:2]).all() and y[2] == 1


def test_stateful_specs_get_fresh_objects_and_stateless_are_shared():
    assert codecs.get("int8") is codecs.get("int8")
    a, b = codecs.get("powersgd"), codecs.get("powersgd")
    assert a is not b and a == b
    a.roundtrip(torch.randn(32, 16))
    assert "q" in a.state_dict() and b.state_dict() == {}
    e1, e2 = codecs.get("topk:ef"), codecs.get("topk:ef")
    assert e1.inner is e2.inner  # stateless inner shared; the wrapper holds the residual
    p1, p2 = codecs.get("powersgd:ef"), codecs.get("powersgd:ef")
    assert p1.inner is not p2.inner


def test_state_is_checkpointable():
    """Reload the state into a fresh codec: identical numerics from there on."""
    torch.manual_seed(0)
    xs = [torch.randn(32, 24) for _ in range(4)]
    for spec in ["powersgd:rank=2,ef", "qsgd:ef", "randomk:ratio=0.3", "terngrad"]:
        a = codecs.get(spec)
        for x in xs[:2]:
            a.roundtrip(x)
        b = codecs.get(spec)
        b.load_state_dict(a.state_dict())
        for x in xs[2:]:
            torch.testing.assert_close(a.roundtrip(x), b.roundtrip(x), rtol=0, atol=0)


def test_state_allocated_ahead_for_buffers():
    codec = codecs.get("powersgd:rank=2,ef")
    state = codec.reset_state((32, 24), torch.float32)
    assert sorted(state) == ["q", "residual"]
    assert state["q"].shape == (24, 2) and state["residual"].shape == (32, 24)
    codec.roundtrip(torch.randn(32, 24))
    assert codec.state_dict()["q"] is state["q"]  # updated in place


def test_one_codec_object_per_shape():
    codec = codecs.get("topk:ef")
    codec.roundtrip(torch.randn(10))
    with pytest.raises(CodecError, match="one codec object per tensor"):
        codec.roundtrip(torch.randn(11))


def test_specs_parse_and_print():
    assert codecs.canonical("TopK:ratio=0.01,ef") == "topk:ef"
    assert codecs.canonical("int8:block=128,ef=true") == "int8:block=128,ef"
    assert codecs.get("fp8:fmt=e5m2").spec == "fp8:fmt=e5m2"
    assert codecs.available()["topk"] == {"ratio": 0.01, "ef": False}
    with pytest.raises(ConfigError, match="parameters: ratio, ef"):
        codecs.get("topk:k=3")
    with pytest.raises(ConfigError, match="fmt"):
        codecs.get("fp8:fmt=e3m4")
    with pytest.raises(ConfigError):
        codecs.get("qsgd:levels=0")



@pytest.mark.parametrize("name", ["int8", "int4", "sign", "fp8", "qsgd", "terngrad"])
def test_block_scaled_codecs_share_the_base_and_its_block_check(name):
    """One family: codes plus one fp32 scale per block, one block check (ccfx.codecs.blockwise),
    and the spec keeps each codec's own parameter order."""
    from ccfx.codecs.blockwise import BlockScaled

    assert isinstance(codecs.get(name), BlockScaled)
    _codes, scales = codecs.get(name).payload_layout((1000,), torch.float32)
    assert scales == ((4,), torch.float32)
    with pytest.raises(ConfigError, match="block must be a positive integer, got 0"):
        codecs.get(f"{name}:block=0")
    assert codecs.canonical("qsgd:block=16,levels=15") == "qsgd:levels=15,block=16"
    assert codecs.canonical("fp8:block=16,fmt=e5m2") == "fp8:fmt=e5m2,block=16"

def test_integer_tensors_are_refused():
    with pytest.raises(CodecError, match="Use codec 'none'"):
        codecs.get("int8").encode(torch.arange(4))


def test_wire_ratios_on_4096_square_fp32():
    """The figures quoted in the README (fp32, 4096 x 4096)."""
    raw = 4096 * 4096 * 4
    expect = {
        "none": 1.0, "fp16": 0.5, "bf16": 0.5, "fp8": 0.25390625, "int8": 0.25390625,
        "int4": 0.12890625, "qsgd": 0.25390625, "terngrad": 0.06640625, "sign": 0.03515625,
        "topk": 0.02, "randomk": 0.01, "threshold": 0.02 + 4 / raw, "powersgd": 0.001953125,
    }
    for spec, ratio in expect.items():
        got = codecs.get(spec).wire_bytes((4096, 4096), torch.float32) / raw
        assert math.isclose(got, ratio, rel_tol=1e-4), (spec, got)


@pytest.mark.parametrize("name", ["int8", "int4", "sign"])
def test_blockwise_codecs_dispatch_to_triton_on_cuda(name):
    """No GPU here: check the dispatch itself picks the Triton launchers for CUDA tensors and
    the torch references otherwise."""
    import importlib
    from types import SimpleNamespace

    codec = codecs.get(name)
    kernels = importlib.import_module(f"ccfx.backends.triton.{name}")
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert codec._impl(cuda, "encode") is getattr(kernels, f"{name}_encode")
    assert codec._impl(cuda, "decode") is getattr(kernels, f"{name}_decode")
    assert codec._impl(cpu, "encode") is type(codec).encode_reference
