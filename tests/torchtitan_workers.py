"""What each rank runs in tests/test_torchtitan.py (module level: spawn pickles them by name).

The model is torchtitan 0.3.0's llama3 debug model (its first two blocks, to keep the spawn
short), parallelized by torchtitan's own ``parallelize_llama`` (``fully_shard`` on the
embeddings, each block, norm + head together, and the model; bf16 gathers, fp32
reduce-scatters, gradient division off: its trainer's defaults), through the hook point
examples/torchtitan_fsdp2.py documents (``with_ccfx``), with that example's CPU stand-ins.
Workers return plain data; the assertions are in the test file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ccfx
import ccfx.integrations
from ccfx.runtime.fsdp2_comms import fsdp2_state_of

from .ranks import digest, raised, rng

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_fsdp2.py"
LAYERS, BATCH, SEQ, VOCAB = 2, 2, 32, 2048


def example():
    """examples/torchtitan_fsdp2.py, imported (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("torchtitan_fsdp2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Dynamo reads a traced function's module from there
    spec.loader.exec_module(module)
    return module


def _force_sum(model) -> None:
    """gloo has no PREMUL_SUM, the op FSDP passes a raw reduce-scatter when torchtitan sets
    its gradient divide factor to 1: sum instead (the same values)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _watch_gathers(model) -> list[str]:
    """Digests of block 0's gathered (bf16, unsharded) parameters at each of its forwards
    (of copies: FSDP frees the unsharded storage)."""
    seen: list[str] = []
    model.layers["0"].attention.register_forward_pre_hook(
        lambda m, args: seen.append(digest([p.detach().clone() for p in m.parameters()])))
    return seen


def train(rank: int, world: int, codecs, steps: int = 4, force_sum: bool = True) -> dict:
    """``steps`` AdamW steps of torchtitan's debug model: plain torchtitan FSDP2 (``codecs``
    None) or with ccfx's comms through the example's hook; each rank its own tokens. The
    losses, the full parameters' digest, block 0's gathered parameters' digests, and with
    codecs the ledger's bytes by kind and the plan."""
    ex = example()
    saved = os.environ.get("CCFX_CODEC_COMPILE")
    os.environ["CCFX_CODEC_COMPILE"] = "0"  # eager codecs: no inductor compile per buffer
    try:
        with ex.cpu_stand_ins():
            from torchtitan.models.llama3 import parallelize_llama

            fn = parallelize_llama if codecs is None else ex.with_ccfx(parallelize_llama,
                                                                       codecs)
            model = ex.debug_model(world, fn, layers=LAYERS)
            if force_sum:
                _force_sum(model)
            return _train(model, ex.causal_mask(BATCH, SEQ), rank, world, steps,
                          codecs is not None)
    finally:
        os.environ.pop("CCFX_CODEC_COMPILE")
        if saved is not None:
            os.environ["CCFX_CODEC_COMPILE"] = saved


def _train(model, mask, rank: int, world: int, steps: int, counted: bool) -> dict:
    gathers = _watch_gathers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=rng(rank))
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1], positions, mask)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        (loss / world).backward()  # torchtitan's FSDP sums; its trainer scales the loss
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor() for p in model.parameters()]
    out = {"losses": losses, "params": digest(full), "gathers": gathers}
    if counted:
        out.update(_figures(model))
    return out


def _figures(model) -> dict:
    """The ledger's raw and wire bytes by collective kind, its steps, the plan's text, the
    codecs that ran and the FSDP modules whose comms never ran."""
    state = fsdp2_state_of(model)
    ledger = ccfx.ledger_of(model)
    kind_of = {ch.index: ch.kind for ch in state.channels.values()}
    by_kind: dict[str, list[int]] = {}
    for e in ledger.entries("collective"):
        raw, wire = by_kind.setdefault(kind_of[e.edge], [0, 0])
        by_kind[kind_of[e.edge]] = [raw + e.raw_bytes, wire + e.wire_bytes]
    return {"bytes": by_kind, "steps": ledger.steps, "plan": str(ccfx.plan_of(model)),
            "codecs": sorted({(ch.kind, ch.codec) for ch in state.channels.values()
                              if ch.call is not None}),
            "idle": sorted({ch.module for ch in state.channels.values() if ch.call is None})}


def raw_premul_sum_on_gloo(rank: int, world: int) -> str | None:
    """torchtitan's gradient division off (FSDP then passes PREMUL_SUM(1.0)) with ccfx's
    ``"none"`` (torch's own reduce-scatter) on gloo, which has no PREMUL_SUM: the error."""
    return raised(rank, world, train, "none", steps=1, force_sum=False)
