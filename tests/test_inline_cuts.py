"""Cuts offered to inductor as plain ops (passes/inline_cuts.py, option ``fuse_codecs``).

Under ``lowering="inductor"`` a cut whose codec is stateless and of fixed size is traced into
the AOT graph as the codec's reference ops, so inductor fuses its encode with the kernel that
produced the crossing value and its decode with the one that reads it. What must not change:
the numbers (the same reference functions, in the same order), the ledger (the same rows,
counted after each call from the codec's fixed wire size), and every cut a codec cannot be
traced for (a stateful one) stays the opaque op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ccfx
from ccfx.backends.compiler import backend_of

pytestmark = pytest.mark.inductor


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 8))


def _train(options: dict, steps: int = 2) -> dict:
    """Two forward/backward steps of the MLP cut in two, under inductor with ``options``: the
    outputs and gradients, the ledger's rows and the cuts inductor received inlined."""
    model = _mlp()
    run = torch.compile(model, backend="ccfx",
                        options={"stages": 2, "lowering": "inductor", **options})
    outs = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        y = run(x)
        y.square().sum().backward()
        outs.append(y.detach())
    lowered = backend_of(run).graphs[0].lowered
    return {"values": torch.cat([o.flatten() for o in outs]
                                + [p.grad.flatten() for p in model.parameters()]),
            "ledger": [(e.edge, e.direction, e.calls, e.raw_bytes, e.wire_bytes)
                       for e in ccfx.ledger_of(run).entries()],
            "inlined": [(c.direction, c.codec) for c in lowered.inlined_cuts]}


@pytest.fixture(scope="module")
def int8_runs():
    return {fuse: _train({"activation_codec": "int8", "fuse_codecs": fuse})
            for fuse in (True, False)}


def test_an_int8_cut_is_inlined_both_ways_and_computes_what_the_op_computes(int8_runs):
    fused, opaque = int8_runs[True], int8_runs[False]
    assert fused["inlined"] == [("fwd", "int8"), ("bwd", "int8")]
    assert opaque["inlined"] == []
    # the same reference functions in the same order: measured bit-equal here; the bound
    # leaves room for inductor computing the producer inside the fused kernel (float rounding)
    torch.testing.assert_close(fused["values"], opaque["values"], rtol=1e-5, atol=1e-6)


def test_the_ledger_counts_the_same_bytes_as_the_op(int8_runs):
    fused, opaque = int8_runs[True], int8_runs[False]
    assert fused["ledger"] == opaque["ledger"]
    n = 32 * 128  # the crossing activation, and its gradient
    assert fused["ledger"] == [(0, d, 2, 2 * 4 * n, 2 * (n + 4 * (n // 256)))
                               for d in ("fwd", "bwd")]


def test_a_stateful_codec_stays_the_opaque_op_and_is_still_counted():
    got = _train({"activation_codec": "fp16", "activation_grad_codec": "int8:ef"})
    assert got["inlined"] == [("fwd", "fp16")]  # the error-feedback direction is not traced
    assert [row[:3] for row in got["ledger"]] == [(0, "fwd", 2), (0, "bwd", 2)]


def test_a_second_compile_of_the_same_model_counts_its_bytes_too():
    """A hit in AOT autograd's cache would serve the second compile without calling ccfx's
    compilers, and so without its byte counts: graphs with cuts to inline bypass that cache
    (torch bypasses it today for any graph holding a Python custom op; ccfx does regardless)."""
    first = _train({"activation_codec": "int8"}, steps=1)
    torch._dynamo.reset()
    again = _train({"activation_codec": "int8"}, steps=1)
    assert again["ledger"] == first["ledger"] and again["inlined"] == first["inlined"]


def test_fuse_codecs_takes_a_bool():
    with pytest.raises(ccfx.ConfigError, match="fuse_codecs is True or False, got 'yes'"):
        ccfx.Config(fuse_codecs="yes")
