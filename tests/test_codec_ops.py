"""The generic custom ops ``ccfx_codecs::encode`` / ``decode``: opcheck for every codec, and
the ops inside a compiled function with the state copied back."""

import pytest
import torch

from ccfx import codecs
from ccfx.codecs import ops

SPECS = [*codecs.names(), "topk:ratio=0.1,ef", "powersgd:rank=2,ef", "randomk:ef"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(37, 5), (300,)])
def test_opcheck(spec, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    state = ops.init_state(spec, x.shape, x.dtype)
    torch.library.opcheck(torch.ops.ccfx_codecs.encode, (x, spec, state))
    payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
    args = (payload, spec, list(x.shape), x.dtype, new)
    torch.library.opcheck(torch.ops.ccfx_codecs.decode, args)


@pytest.mark.parametrize("spec", ["int8", "topk:ratio=0.1,ef", "powersgd:rank=2,ef", "randomk"])
def test_ops_equal_object_api(spec):
    """Op calls with state threaded through give the object API's numbers, step after step."""
    torch.manual_seed(0)
    xs = [torch.randn(32, 24) for _ in range(3)]
    codec = codecs.get(spec)
    state = ops.init_state(spec, (32, 24), torch.float32)
    for x in xs:
        payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
        state = new
        y, state = torch.ops.ccfx_codecs.decode(payload, spec, [32, 24], torch.float32, state)
        torch.testing.assert_close(y, codec.roundtrip(x), rtol=0, atol=0)


def test_ops_compile_with_state_copy_back():
    spec = "topk:ratio=0.25,ef"
    residual = ops.init_state(spec, (16, 8), torch.float32)

    def roundtrip(x, state):
        payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
        y, new = torch.ops.ccfx_codecs.decode(payload, spec, list(x.shape), x.dtype, new)
        for s, n in zip(state, new):
            s.copy_(n)
        return y

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    eager_state = ops.init_state(spec, (16, 8), torch.float32)
    for _ in range(3):
        x = torch.randn(16, 8)
        torch.testing.assert_close(compiled(x, residual), roundtrip(x, eager_state))
        torch.testing.assert_close(residual[0], eager_state[0])
    assert residual[0].abs().sum() > 0


def test_state_count_is_checked():
    with pytest.raises(ValueError, match="init_state"):
        torch.ops.ccfx_codecs.encode(torch.randn(8), "topk:ef", [])
