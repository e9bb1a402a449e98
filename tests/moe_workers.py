"""What each rank runs in tests/test_moe_all_to_all.py (module level: spawn pickles them by name).

An expert-parallel MoE layer written with torch's functional collectives, 2 experts, one per
rank, top-1 routing: an input projection and a router (each rank its own copy), tokens sorted by
the expert they go to, an ``all_to_all_single`` with split sizes sends them to their expert
(dispatch), the expert (``tanh(Linear)``) runs on what it received, a second all_to_all with the
splits swapped sends the results back (combine), each token's result is scaled by its gate and
put back in token order. Two ways to give the split sizes:

* :class:`CapacityMoE`: fixed capacities as Python ints, ``caps[r][j]`` tokens of rank ``r`` to
  expert ``j`` (the tokens that prefer expert 0 most fill its capacity): static, unequal and
  rank-dependent splits, one of them 0. Dynamo bakes them into the graph as constants.
* :class:`CountedMoE`: counts from the router, exchanged by a first all_to_all of counts, read
  with ``.tolist()``. Dynamo breaks the graph there (``capture_scalar_outputs`` off, torch's
  default); the graph it resumes in holds the payload all_to_alls with the counts as int
  constants the first time, and as symbolic sizes (graph inputs) once a second set of counts
  made it recompile.

Workers return plain data; the assertions are in the test file.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn

import ccfx

from . import ranks

#: Tokens per rank and hidden size.
TOKENS, HIDDEN = 8, 16
#: caps[r][j]: tokens rank r sends to expert j: rank 0 sends all 8 to expert 0 (a split of 0
#: rows to expert 1), rank 1 splits 3 / 5; expert 0 receives 11 rows, expert 1 five.
CAPS = ((8, 0), (3, 5))


def _a2a(x, output_splits, input_splits):
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(x, output_splits, input_splits, dist.group.WORLD)


class _MoE(nn.Module):
    def __init__(self, rank: int, world: int):
        super().__init__()
        torch.manual_seed(0)  # projection and router: the same start on every rank
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.router = nn.Linear(HIDDEN, world)
        torch.manual_seed(1 + rank)  # this rank's expert
        self.expert = nn.Linear(HIDDEN, HIDDEN)
        self.world = world

    def _moe(self, h, order, gate, ins, outs):
        """Dispatch ``h[order]`` (``ins`` rows to each expert), the expert, combine, gate, and
        back to token order."""
        got = _a2a(h[order], outs, ins)
        y = torch.tanh(self.expert(got))
        back = _a2a(y, ins, outs)
        return torch.zeros_like(back).index_copy(0, order, back * gate[:, None])


class CapacityMoE(_MoE):
    """Static split sizes (Python ints): see the module docstring. 2 ranks."""

    def __init__(self, rank: int, world: int, caps=CAPS):
        super().__init__(rank, world)
        self.ins = list(caps[rank])
        self.outs = [caps[i][rank] for i in range(world)]
        # the expert of each sorted token, a buffer (a graph input, not a constant: the ranks
        # of a group agree on the code of the graphs they compile, split sizes apart)
        self.register_buffer("expert_of", torch.tensor(
            [j for j, n in enumerate(self.ins) for _ in range(n)]), persistent=False)

    def forward(self, x):
        h = self.proj(x)
        probs = self.router(h).softmax(-1)
        order = (probs[:, 1] - probs[:, 0]).argsort()  # expert 0's favourites first
        gate = probs[order].gather(1, self.expert_of[:, None])[:, 0]
        return self._moe(h, order, gate, self.ins, self.outs)


class CountedMoE(_MoE):
    """Data-dependent split sizes: top-1 routing, counts exchanged, ``.tolist()``."""

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        h = self.proj(x)
        probs = self.router(h).softmax(-1)
        gate, idx = probs.max(-1)
        order = idx.argsort(stable=True)
        counts = nn.functional.one_hot(idx, self.world).sum(0)
        received = funcol.all_to_all_single(counts, None, None, dist.group.WORLD)
        ins, outs = counts.tolist(), received.tolist()
        return self._moe(h, order, gate[order], ins, outs)


def _inputs(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)


def _max_over_ranks(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _scales(model, x) -> list[float]:
    """The scales of the int8 bound, over every rank: the largest dispatched value (the
    projection's output) and the experts' largest row sum of |w| (how much an expert can
    amplify an error in what it receives)."""
    with torch.no_grad():
        h = model.proj(x).abs().max()
        w_inf = model.expert.weight.abs().sum(1).max()
    return _max_over_ranks(float(h), float(w_inf))


def _plan(compiled) -> list[dict]:
    return [dataclasses.asdict(c) for c in ccfx.plan_of(compiled).collectives]


def _step(model, x, target):
    out = model(x)
    loss = (out - target).square().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return out.detach(), loss.item(), grads


def compare(rank, world, codec, lowering="eager", **options):
    """One forward and backward of the capacity MoE compiled with ``backend="ccfx"``, ``codec``
    and ``lowering`` (and ``options``) against the same model run eagerly (torch's own
    all_to_all): the errors, the scales their bound is derived from, the plan and the ledger."""
    model, eager = CapacityMoE(rank, world), CapacityMoE(rank, world)
    compiled = torch.compile(model, backend="ccfx", options={
        "lowering": lowering, "collective_codec": codec, **options})
    x, target = _inputs(rank)
    out, _, grads = _step(compiled, x, target)
    want, _, want_grads = _step(eager, x, target)
    h_max, w_max = _scales(eager, x)
    return {
        "equal": torch.equal(out, want) and all(torch.equal(a, b)
                                                for a, b in zip(grads, want_grads)),
        "out_err": float((out - want).abs().max()),
        "grad_err": max(float((a - b).abs().max()) for a, b in zip(grads, want_grads)),
        "grad_scale": max(float(b.abs().max()) for b in want_grads),
        "h_max": h_max, "w_inf": w_max,
        "shape": list(out.shape),
        "plan": _plan(compiled),
        "ledger": _ledger(compiled),
    }


def train(rank, world, codec, steps):
    """``steps`` SGD steps of the capacity MoE (every parameter on each rank its own, no data
    parallelism) towards a fixed target; the losses."""
    model = CapacityMoE(rank, world)
    compiled = torch.compile(model, backend="ccfx",
                             options={"lowering": "eager", "collective_codec": codec})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, target = _inputs(rank)
    losses = ranks.train(lambda _: (compiled(x) - target).square().mean(), opt, range(steps))
    return {"losses": losses, "plan": _plan(compiled)}


def _ledger(compiled) -> list[tuple]:
    return [(e.edge, e.calls, e.raw_bytes, e.wire_bytes)
            for e in ccfx.ledger_of(compiled).entries("collective")]


def _grown(model, rank, x, target):
    """``x`` and ``target`` with one more token on rank 1: a copy of a token its router sends to
    rank 1's own expert, so only rank 1's split sizes change (rank 0's stay as they were)."""
    if rank != 1:
        return x, target
    with torch.no_grad():
        idx = model.router(model.proj(x)).argmax(-1)
    (mine,) = (idx == rank).nonzero()[:1, 0].tolist() or [None]
    assert mine is not None, "no token of rank 1 goes to its own expert: pick other inputs"
    return torch.cat([x, x[mine:mine + 1]]), torch.cat([target, target[mine:mine + 1]])


def counted(rank, world, codec, steps, capture=False, lowering="eager", hold_rank0=False,
            grow_rank1=False, **options):
    """The counted MoE over ``steps`` inputs whose routing differs: every step's output
    against eager, the counts each step routed, the scales of the int8 bound, the plan (every
    graph Dynamo compiled). ``capture=False`` (torch's default): Dynamo breaks the graph at
    ``.tolist()`` and bakes the counts into the graph it resumes in (one step here: new counts
    recompile it, and each rank recompiles when its own counts change). ``capture=True``
    (``capture_scalar_outputs``): one graph whose split sizes are unbacked SymInts, compiled
    once for every step: ``graphs`` counts what Dynamo compiled, the ledger what ran.
    ``hold_rank0``: rank 0 repeats its first input at step 1, so at that step only the other
    ranks see new counts and recompile. ``grow_rank1``: from step 1 on, every rank repeats its
    first input and rank 1 adds a token its own expert takes (an uneven batch): rank 1 alone
    recompiles (its token count and split sizes become symbolic), rank 0 runs its first graphs.
    A step that raises says how long it ran (``ccfx_step_s`` on the error)."""
    from torch._dynamo.utils import counters

    counters.clear()
    model, eager = CountedMoE(rank, world), CountedMoE(rank, world)
    compiled = torch.compile(model, backend="ccfx", options={
        "lowering": lowering, "collective_codec": codec, **options})
    rows = []
    with torch._dynamo.config.patch(capture_scalar_outputs=capture):
        for step in range(steps):
            x, target = _inputs(rank, 0 if (hold_rank0 and rank == 0 and step == 1)
                                or grow_rank1 else step)
            if grow_rank1 and step:
                x, target = _grown(eager, rank, x, target)
            began = time.monotonic()
            try:
                out, _, grads = _step(compiled, x, target)
            except Exception as e:
                e.ccfx_step_s = time.monotonic() - began
                raise
            want, _, want_grads = _step(eager, x, target)
            with torch.no_grad():
                idx = eager.router(eager.proj(x)).argmax(-1)
            counts = torch.bincount(idx, minlength=world)
            every = [torch.zeros_like(counts) for _ in range(world)]
            dist.all_gather(every, counts)
            h_max, w_inf = _scales(eager, x)
            rows.append({"equal": torch.equal(out, want) and all(
                             torch.equal(a, b) for a, b in zip(grads, want_grads)),
                         "err": float((out - want).abs().max()),
                         "grad_err": max(float((a - b).abs().max())
                                         for a, b in zip(grads, want_grads)),
                         "grad_scale": max(float(b.abs().max()) for b in want_grads),
                         "h_max": h_max,
                         "w_inf": w_inf, "counts": counts.tolist(),
                         # the rows this rank's expert received (dispatched to it)
                         "received": int(sum(int(c[rank]) for c in every))})
    return {"steps": rows, "plan": _plan(compiled), "ledger": _ledger(compiled),
            "graphs": counters["stats"]["unique_graphs"],
            "plan_graphs": len(ccfx.plan_of(compiled).graphs)}


def train_counted(rank, world, codec, steps):
    """``steps`` SGD steps of the counted MoE under ``capture_scalar_outputs`` (one graph, the
    split sizes unbacked SymInts) towards a fixed target; the losses and the counts each step
    routed (training moves the router)."""
    model = CountedMoE(rank, world)
    compiled = torch.compile(model, backend="ccfx",
                             options={"lowering": "eager", "collective_codec": codec})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, target = _inputs(rank)
    counts = []

    def step_loss(_):
        with torch.no_grad():
            idx = model.router(model.proj(x)).argmax(-1)
        counts.append(torch.bincount(idx, minlength=world).tolist())
        return (compiled(x) - target).square().mean()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        losses = ranks.train(step_loss, opt, range(steps))
    return {"losses": losses, "counts": counts, "plan": _plan(compiled)}


def counted_fails(rank, world, *args, **kwargs):
    """:func:`counted` where a step must fail: the error's type and message, and how long the
    failing step ran (``None`` for each when every step ran)."""
    try:
        counted(rank, world, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 (the test asserts on the type and message)
        return {"error": type(e).__name__, "message": str(e),
                "step_s": getattr(e, "ccfx_step_s", None)}
    return {"error": None, "message": None, "step_s": None}
