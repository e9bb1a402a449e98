"""What each rank runs in tests/test_wire_collectives.py (module level: spawn pickles them by
name), and the helpers the single-process tests share with them.

Every rank draws its own input from a seed of (rank, case); the references are torch's own
collective on the same inputs (gloo, eagerly) and an fp64 computation from every rank's input,
gathered raw. Workers return plain data (digests, floats); the assertions are in the test file.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.distributed as dist

from ccfx.wire.collectives import CollectiveCall, CompressedCollective
from ccfx.wire.comm import FunctionalComm, ProcessGroupComm

from .ranks import digest, gathered, rng

#: Bytes each rank sends when a collective's input tensor has ``nbytes`` (ring algorithms'
#: convention, as ``CollectiveCall.raw_bytes``).
SENT = {"all_reduce": lambda n, w: Fraction(2 * (w - 1) * n, w),
        "all_gather": lambda n, w: Fraction((w - 1) * n),
        "reduce_scatter": lambda n, w: Fraction((w - 1) * n, w),
        "all_to_all": lambda n, w: Fraction((w - 1) * n, w)}


class CountingComm:
    """A ``Comm`` that records, per collective it issues, its kind and its input's bytes."""

    def __init__(self, inner):
        self.inner = inner
        self.world = inner.world
        self.issued: list[tuple[str, int]] = []

    def _issue(self, kind, t):
        self.issued.append((kind, t.numel() * t.element_size()))
        return getattr(self.inner, kind)(t)

    def all_reduce(self, t):
        return self._issue("all_reduce", t)

    def all_gather(self, t):
        return self._issue("all_gather", t)

    def reduce_scatter(self, t):
        return self._issue("reduce_scatter", t)

    def all_to_all(self, t, *splits):
        self.issued.append(("all_to_all", t.numel() * t.element_size()))
        return self.inner.all_to_all(t, *splits)

    def wait(self, h):
        return self.inner.wait(h)

    def sent(self) -> int:
        """Bytes sent, rounded up to whole bytes as ``CollectiveCall.raw_bytes``."""
        return math.ceil(sum(SENT[k](n, self.world) for k, n in self.issued))


def traced_phases(cc: CompressedCollective, comm, x: torch.Tensor, state: list[torch.Tensor]):
    """Each phase traced with ``make_fx(tracing_mode="fake")`` as a graph pass traces it (the
    inputs: x, the state list, the previous phase's carry), then run on the real tensors: the
    graphs, and the last phase's output."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graphs, carry = [], []
    n_s = len(state)
    for phase in cc.phases:
        def fn(*flat, phase=phase):
            return list(phase(flat[0], list(flat[1:1 + n_s]), list(flat[1 + n_s:]), comm))

        gm = make_fx(fn, tracing_mode="fake")(x, *state, *carry)
        graphs.append(gm)
        carry = list(gm(x, *state, *carry))
    return graphs, carry[0]


def sample(rank: int, case: int, shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=rng(case, rank, stride=7919)).to(dtype)


def join(rank: int, world: int, members: list[int]):
    """The group of ``members`` (every rank must call this: creating a group is collective) and
    this rank's place in it; ``(None, None)`` for a rank outside it."""
    group = dist.group.WORLD if members == list(range(world)) else dist.new_group(members)
    if rank not in members:
        return None, None
    return group, members.index(rank)


def torch_reference(call: CollectiveCall, x: torch.Tensor, group) -> torch.Tensor:
    """torch's own collective (gloo, eager) on ``x``; avg as a sum divided by the world (gloo
    has no AVG)."""
    w = call.world
    if call.kind == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / w if call.reduce_op == "avg" else out
    if call.kind == "all_gather":
        out = x.new_empty(call.out_shape)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out
    if call.kind == "reduce_scatter":
        out = x.new_empty(call.out_shape)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out / w if call.reduce_op == "avg" else out
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def fp64_reference(call: CollectiveCall, rank: int, xs: list[torch.Tensor]) -> torch.Tensor:
    """The exact answer from every rank's input (``xs`` in rank order)."""
    w = call.world
    xs = [x.double() for x in xs]
    if call.kind in ("all_reduce", "reduce_scatter"):
        total = torch.stack(xs).sum(0)
        if call.reduce_op == "avg":
            total = total / w
        return total if call.kind == "all_reduce" else total.chunk(w)[rank]
    if call.kind == "all_gather":
        return torch.cat(xs)
    return torch.cat([x.chunk(w)[rank] for x in xs])


def case_results(rank, world, members, cases, to_trace):
    """On the group of ``members`` (group ranks are not global ranks on a subgroup), per case
    ``(kind, spec, shape, reduce_op, dtype name)``: the eager result's digest (and, for the
    cases in ``to_trace``, the traced one's), whether the result equals torch's own collective
    bit for bit, its largest error against fp64 and the inputs' largest magnitude (every
    rank's), the bytes this rank's collectives sent against ``wire_bytes`` / ``raw_bytes``, and
    the input left untouched. None on a rank outside the group."""
    group, me = join(rank, world, members)
    if group is None:
        return None
    size = len(members)
    out = {}
    for i, (kind, spec, shape, op, dtype_name) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        call = CollectiveCall(kind, tuple(shape), dtype, size, op)
        cc = CompressedCollective(call, spec)
        x = sample(me, i, shape, dtype)
        x_before = x.clone()
        counting = CountingComm(ProcessGroupComm(group))
        eager = cc.run(x, cc.init_state(), counting)
        traced = None
        if (kind, spec, shape, op, dtype_name) in to_trace:
            state = cc.init_state()
            _, traced = traced_phases(cc, FunctionalComm(group.group_name, size), x,
                                      [state[k] for k in sorted(state)])
        xs = gathered(x, group)
        exact = fp64_reference(call, me, xs)
        err = (eager.double() - exact).abs()
        out[(kind, spec, tuple(shape), op, dtype_name)] = {
            "digest": digest(eager), "traced_digest": None if traced is None else digest(traced),
            "shape": tuple(eager.shape), "dtype": str(eager.dtype),
            "equals_torch": bool(torch.equal(eager, torch_reference(call, x, group))),
            "max_err": err.max().item(),
            "rel_l2": (err.norm() / exact.norm()).item(),
            "absmax": max(t.abs().max().item() for t in xs),
            "sent": counting.sent(), "wire_bytes": cc.wire_bytes(), "raw_bytes": cc.raw_bytes,
            "issued_as_said": counting.issued == cc.messages(),
            "input_untouched": bool(torch.equal(x, x_before)),
        }
    return out


def error_feedback(rank, world, members, kind, spec, shape, steps):
    """On the group of ``members``: ``steps`` calls of one compressed collective on fresh inputs
    with one state; per call the residuals' digest and norm, the result's digest and its error
    against fp64 (the residual carries what the codec dropped into the next call)."""
    group, me = join(rank, world, members)
    if group is None:
        return None
    op = "sum" if kind in ("all_reduce", "reduce_scatter") else None
    call = CollectiveCall(kind, tuple(shape), torch.float32, len(members), op)
    cc = CompressedCollective(call, spec)
    state = cc.init_state()
    comm = ProcessGroupComm(group)
    rows = []
    for step in range(steps):
        x = sample(me, 100 + step, shape)
        y = cc.run(x, state, comm)
        exact = fp64_reference(call, me, gathered(x, group))
        residuals = [state[k] for k in sorted(state) if k.endswith("residual")]
        rows.append({"digest": digest(residuals),
                     "norm": torch.stack([r.norm() for r in residuals]).norm().item(),
                     "out_digest": digest(y),
                     "max_err": (y.double() - exact).abs().max().item()})
    return {"names": sorted(state), "rows": rows}


def int8_all_reduce_error(rank, world, shape):
    """The relative L2 error of the int8 all-reduce (sum) of a Gaussian tensor, against fp64."""
    call = CollectiveCall("all_reduce", tuple(shape), torch.float32, world, "sum")
    cc = CompressedCollective(call, "int8")
    x = sample(rank, 999, shape)
    y = cc.run(x, cc.init_state(), ProcessGroupComm())
    exact = fp64_reference(call, rank, gathered(x))
    return {"rel_l2": ((y.double() - exact).norm() / exact.norm()).item(),
            "wire_bytes": cc.wire_bytes(), "raw_bytes": cc.raw_bytes, "digest": digest(y)}


def interleaved(rank, world, members):
    """Three compressed collectives in flight at once on one group, their phases interleaved as
    a graph pass places them (every phase 0, then the middle phases, then the last ones), over
    ProcessGroupComm: the results' digests, and each one's digest when it runs alone."""
    group, me = join(rank, world, members)
    if group is None:
        return None
    size = len(members)
    calls = [(CollectiveCall("all_reduce", (9, 31), torch.float32, size, "sum"), "int8"),
             (CollectiveCall("all_gather", (4, 33), torch.float32, size), "fp8"),
             (CollectiveCall("all_reduce", (300,), torch.float32, size, "avg"), "int4:ef")]
    ccs = [CompressedCollective(call, spec) for call, spec in calls]
    xs = [sample(me, 50 + i, call.shape) for i, (call, _) in enumerate(calls)]
    comm = ProcessGroupComm(group)
    alone = [digest(cc.run(x, cc.init_state(), comm)) for cc, x in zip(ccs, xs)]
    states = [cc.init_state() for cc in ccs]
    lists = [[s[k] for k in sorted(s)] for s in states]
    carries: list = [[] for _ in ccs]
    for i, cc in enumerate(ccs):
        carries[i] = cc.phases[0](xs[i], lists[i], carries[i], comm)
    for i, cc in enumerate(ccs):
        for phase in cc.phases[1:-1]:
            carries[i] = phase(xs[i], lists[i], carries[i], comm)
    for i, cc in enumerate(ccs):
        carries[i] = cc.phases[-1](xs[i], lists[i], carries[i], comm)
    return {"together": [digest(c[0]) for c in carries], "alone": alone}


def non_finite(rank, world, members):
    """A NaN in one element of the last rank's input: the int8 all-reduce's result is NaN in
    that element's block and finite elsewhere, on every rank alike."""
    group, me = join(rank, world, members)
    if group is None:
        return None
    size = len(members)
    call = CollectiveCall("all_reduce", (1000,), torch.float32, size, "sum")
    cc = CompressedCollective(call, "int8")
    x = sample(me, 70, (1000,))
    if me == size - 1:
        x[10] = float("nan")
    y = cc.run(x, cc.init_state(), ProcessGroupComm(group))
    return {"nan_at": torch.isnan(y).nonzero().view(-1).tolist(), "digest": digest(y),
            "chunk": cc.chunk}


#: Rows rank r sends to rank j in the unequal all_to_all cases (2 ranks, 3 ranks): splits of 0
#: rows, a rank that sends nothing (rank 1 of 3) and one that receives a single row.
SPLITS = {2: ((3, 5), (6, 0)), 3: ((3, 5, 0), (0, 0, 0), (6, 2, 1))}


def unequal_rows(rank, world, members, cases, to_trace):
    """On the group of ``members``: per case ``(spec, row)``, an all_to_all of ``SPLITS`` rows
    of ``row`` elements: whether the eager result equals torch's all_to_all_single bit for bit,
    its largest error and every rank's largest |input|, the traced phases' digest against the
    eager one's, its shape against ``out_shape``, the bytes sent against ``wire_bytes`` and the
    messages issued against ``messages()``."""
    group, me = join(rank, world, members)
    if group is None:
        return None
    size = len(members)
    matrix = SPLITS[size]
    ins, outs = matrix[me], tuple(matrix[i][me] for i in range(size))
    out = {}
    for i, (spec, row) in enumerate(cases):
        x = sample(me, 300 + i, (sum(ins), row))
        call = CollectiveCall("all_to_all", tuple(x.shape), x.dtype, size, None, ins, outs)
        cc = CompressedCollective(call, spec)
        counting = CountingComm(ProcessGroupComm(group))
        eager = cc.run(x, cc.init_state(), counting)
        want = x.new_empty(call.out_shape)
        dist.all_to_all_single(want, x, list(outs), list(ins), group=group)
        traced = None
        if (spec, row) in to_trace:
            state = cc.init_state()
            _, traced = traced_phases(cc, FunctionalComm(group.group_name, size), x,
                                      [state[k] for k in sorted(state)])
        top = torch.tensor([x.abs().max().item() if x.numel() else 0.0])
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        out[(spec, row)] = {
            "equals_torch": bool(torch.equal(eager, want)),
            "max_err": (eager - want).abs().max().item() if want.numel() else 0.0,
            "absmax": top.item(), "rows_in": len(ins) and sum(ins),
            "shape_ok": tuple(eager.shape) == call.out_shape,
            "traced_equal": None if traced is None else digest(traced) == digest(eager),
            "sent": counting.sent(), "wire_bytes": cc.wire_bytes(),
            "issued_as_said": counting.issued == cc.messages(),
        }
    return out
