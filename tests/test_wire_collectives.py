"""The compressed collectives of the wire layer (ccfx.wire.collectives, issue #18): all-reduce,
all-gather, reduce-scatter and all-to-all through a codec.

Single-process tests: refuse()'s reasons, the phases traced with make_fx over FunctionalComm
(fake tensors need no process group: the graph's collectives and their input bytes are read
off the trace), the packing of a chunk's payload, LocalComm's new methods. Multi-rank tests:
in the 3-rank spawn the modules share (tests/ranks.py, ``Shared``), the 2-rank cases on a
subgroup of it, every case run eagerly over ProcessGroupComm and traced over FunctionalComm
then run; workers in
tests/wire_collectives_workers.py.

Error bounds (A: the largest input magnitude over every rank; e: the codec's relative half
step: int8 1/254 (absmax / 127 steps, round to nearest), int4 1/14, fp8 e4m3 1/16 (three
mantissa bits), bf16 2**-8): one encode errs by at most ``e`` times its block's absmax.
all_gather and all_to_all decode each value once: ``e A``. reduce_scatter sums ``W`` decoded
values: ``W e A``. all_reduce adds the owner's encode of a sum whose magnitude is at most
``W A (1 + e)``: ``W e A (2 + e)``. ``avg`` divides by ``W``. A bf16 input adds its own rounding
(2**-8 relative) at each decode and at the owner's cast: ``e + 2 * 2**-8``. The tests allow 10 %
on top (fp32 summation, the second-order terms).
"""

from __future__ import annotations

import pytest
import torch

from ccfx.errors import ConfigError
from ccfx.wire.collectives import KINDS, CollectiveCall, CompressedCollective, refuse
from ccfx.wire.comm import FunctionalComm, LocalComm

from . import wire_collectives_workers as w
from .ranks import Shared, scenario
from .unbacked_graphs import traced_with_unbacked_sizes, unbacked_rows

SPECS = ["none", "int8", "int4", "fp8", "bf16", "topk:ratio=0.25"]
HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 1 / 16, "bf16": 2 ** -8}
OP = {"all_reduce": "sum", "reduce_scatter": "sum", "all_gather": None, "all_to_all": None}


def shapes(kind: str, world: int) -> list[tuple[int, ...]]:
    """An odd small shape (numel not divisible by W, inside one block), one across blocks
    (numel not a multiple of the block, 256), both encoded chunk by chunk, and one whose chunks
    are whole blocks (every chunk in one encode); dim 0 divisible by W where the kind needs it."""
    if kind in ("reduce_scatter", "all_to_all"):
        return [(world * 3, 7), (world * 2, 301), (world * 2, 256)]
    if kind == "all_gather":
        return [(3, 5), (2, 300), (2, 256)]
    return [(5, 7), (3, 300), (world * 2, 256)]


def cases(world: int) -> list[tuple]:
    out = [(k, s, shape, OP[k], "float32") for k in KINDS for s in SPECS
           for shape in shapes(k, world)[:{"int4": 2, "topk:ratio=0.25": 1}.get(s, 3)]]
    for kind in ("all_reduce", "reduce_scatter"):
        out.append((kind, "none", shapes(kind, world)[0], "avg", "float32"))
        out.append((kind, "int8", shapes(kind, world)[1], "avg", "float32"))
    for kind in KINDS:  # chunks of 10490 elements, padded to 41 whole blocks
        shape = {"all_reduce": (world * 10490 - 1,), "all_gather": (10490,)}.get(
            kind, (world, 10490))
        out.append((kind, "int8", shape, OP[kind], "float32"))
    out.append(("all_reduce", "int8", (4, 130), "sum", "bfloat16"))
    out.append(("all_gather", "fp8", (4, 130), None, "bfloat16"))
    out.append(("reduce_scatter", "int8", (world * 2, 130), "sum", "float64"))
    return out


def bound(case, world: int, absmax: float) -> float:
    kind, spec, _, op, dtype = case
    e = HALF_STEP[spec] + (2 * 2 ** -8 if dtype == "bfloat16" else 0.0)
    per = {"all_gather": e, "all_to_all": e, "reduce_scatter": world * e,
           "all_reduce": world * e * (2 + e)}[kind]
    if op == "avg":
        per /= world
    return 1.1 * per * absmax


#: Specs whose phases are also traced with make_fx and run (tracing costs ~0.1 s a phase): the
#: identity, a two-tensor payload (int8: chunk by chunk on the odd shapes, in one encode on the
#: aligned one), a cast (always in one encode).
TRACED = ("none", "int8", "bf16")


def traced(world: int) -> list[tuple]:
    """The cases traced too: TRACED's specs on the odd shape and the aligned one."""
    return [c for c in cases(world)
            if c[1] in TRACED and c[3] != "avg" and c[4] == "float32"
            and c[2] in (shapes(c[0], world)[0], shapes(c[0], world)[2])]


#: Unequal all_to_all splits (whole rows): a row inside one block (7), one across blocks
#: (300: padded to 512 for the encode, 300 codes sent) and whole blocks (256).
ROW_SPECS = ["none", "int8", "int4", "fp8", "bf16", "int8:ef"]
ROW_CASES = [(s, row) for s in ROW_SPECS for row in (7, 300, 256)]
ROW_TRACED = [("none", 7), ("int8", 7), ("int8", 300), ("bf16", 256)]


def _scenarios() -> list[tuple]:
    """The 3-rank cases on all 3 ranks, the 2-rank cases on the subgroup of ranks 1 and 2
    (group ranks 0 and 1: not the global ones)."""
    scenarios = []
    for world, members in ((2, [1, 2]), (3, [0, 1, 2])):
        scenarios += [
            scenario(f"cases{world}", w.case_results, members, cases(world), traced(world)),
            scenario(f"ef_rs{world}", w.error_feedback, members, "reduce_scatter", "int4:ef",
                     (world * 4, 300), 3),
            scenario(f"ef_ar{world}", w.error_feedback, members, "all_reduce", "int8:ef",
                     (7, 50), 2),
            scenario(f"interleaved{world}", w.interleaved, members),
            scenario(f"non_finite{world}", w.non_finite, members),
            scenario(f"rows{world}", w.unequal_rows, members, ROW_CASES, ROW_TRACED)]
    scenarios.append(scenario("int8_error", w.int8_all_reduce_error, (192, 1000)))
    return scenarios


#: In the 3-rank spawn the modules share (tests/ranks.py, ``Shared``).
THREE = Shared(3, _scenarios(), timeout_s=240)


@pytest.fixture(scope="module")
def spawned(shared_ranks):
    return shared_ranks[THREE]


class _Group:
    """One world size's results: ``self[name]`` is the group's ranks' values, in group order."""

    def __init__(self, spawned, world):
        self.spawned, self.world = spawned, world

    def __getitem__(self, name):
        got = self.spawned[f"{name}{self.world}"]
        return [r for r in got if r is not None]


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def ranks(request, spawned):
    """(W, the W ranks' results)."""
    return request.param, _Group(spawned, request.param)


# -- on ranks -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_identity_is_torchs_own_collective_bit_for_bit(ranks):
    world, got = ranks
    rows = got["cases"]
    for case in cases(world):
        if case[1] == "none":
            for rank, r in enumerate(rows):
                assert r[case]["equals_torch"], (world, rank, case)


@pytest.mark.slow
def test_lossy_codecs_stay_within_the_block_bound(ranks):
    world, got = ranks
    rows = got["cases"]
    checked = 0
    for case in cases(world):
        if case[1] in HALF_STEP:
            for r in rows:
                row = r[case]
                assert 0 < row["max_err"] <= bound(case, world, row["absmax"]), (world, case, row)
                checked += 1
    assert checked >= (3 * 3 + 2 + 1) * len(KINDS) * world


@pytest.mark.slow
def test_topk_is_lossy_but_close(ranks):
    """topk keeps a quarter of each chunk: not bounded like a quantiser, but it must not be
    garbage (the relative L2 error of keeping the largest 25 % of a Gaussian is about 0.6)."""
    world, got = ranks
    for case in cases(world):
        if case[1].startswith("topk"):
            for r in got["cases"]:
                assert 0 < r[case]["rel_l2"] < 0.95, (world, case, r[case]["rel_l2"])


@pytest.mark.slow
def test_all_reduce_is_bit_identical_on_every_rank(ranks):
    world, got = ranks
    for case in cases(world):
        if case[0] == "all_reduce":
            assert len({r[case]["digest"] for r in got["cases"]}) == 1, (world, case)


@pytest.mark.slow
def test_all_gather_is_bit_identical_on_every_rank(ranks):
    world, got = ranks
    for case in cases(world):
        if case[0] == "all_gather":
            assert len({r[case]["digest"] for r in got["cases"]}) == 1, (world, case)


@pytest.mark.slow
def test_traced_phases_equal_the_eager_ones(ranks):
    """make_fx over FunctionalComm, run, gives the eager ProcessGroupComm's bits."""
    world, got = ranks
    checked = 0
    for case in cases(world):
        if case in traced(world):
            for rank, r in enumerate(got["cases"]):
                assert r[case]["traced_digest"] == r[case]["digest"], (world, rank, case)
                checked += 1
    assert checked == len(TRACED) * len(KINDS) * 2 * world


@pytest.mark.slow
def test_shape_dtype_and_input_are_the_collectives(ranks):
    world, got = ranks
    for case in cases(world):
        kind, _, shape, op, dtype = case
        call = CollectiveCall(kind, shape, getattr(torch, dtype), world, op)
        for r in got["cases"]:
            assert r[case]["shape"] == call.out_shape, case
            assert r[case]["dtype"] == f"torch.{dtype}", case
            assert r[case]["input_untouched"], case


@pytest.mark.slow
def test_wire_bytes_are_the_bytes_sent(ranks):
    world, got = ranks
    for case in cases(world):
        kind, spec, shape, _, dtype = case
        n = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        formula = {"all_reduce": 2 * (world - 1) * n / world, "all_gather": (world - 1) * n,
                   "reduce_scatter": (world - 1) * n / world,
                   "all_to_all": (world - 1) * n / world}[kind]
        for r in got["cases"]:
            row = r[case]
            assert row["sent"] == row["wire_bytes"], (world, case, row)
            assert row["issued_as_said"], (world, case)
            assert row["raw_bytes"] == -(-int(formula * world) // world), (world, case)
            if spec in ("int8", "int4", "fp8") and shape[-1] >= 256:
                assert row["wire_bytes"] < 0.4 * row["raw_bytes"], (world, case)


@pytest.mark.slow
def test_reduce_scatter_error_feedback_keeps_a_changing_residual(ranks):
    world, got = ranks
    for r in got["ef_rs"]:
        assert r["names"] == [f"chunk{j:04d}.residual" for j in range(world)]
        digests = [row["digest"] for row in r["rows"]]
        assert len(set(digests)) == len(digests)
        assert all(row["norm"] > 0 for row in r["rows"])
    # per rank state: the ranks' residuals differ (each keeps its own quantisation error)
    assert len({r["rows"][0]["digest"] for r in got["ef_rs"]}) == world


@pytest.mark.slow
def test_all_reduce_error_feedback_stays_bit_identical(ranks):
    world, got = ranks
    rows = got["ef_ar"]
    assert rows[0]["names"] == [f"chunk{j:04d}.residual" for j in range(world)]
    assert all(row["norm"] > 0 for r in rows for row in r["rows"])
    for step in range(2):
        assert len({r["rows"][step]["out_digest"] for r in rows}) == 1, step


@pytest.mark.slow
def test_unequal_all_to_all_sends_whole_rows_within_the_bound(ranks):
    """Unequal splits (some of 0 rows, a rank that sends nothing): the identity is torch's
    all_to_all_single bit for bit; a lossy codec decodes every received value within its
    half step of the largest |input| (a row is encoded on its own: its scale is its own
    largest value, at most that); traced equals eager; the bytes sent are wire_bytes."""
    world, got = ranks
    for case in ROW_CASES:
        spec = case[0].split(":")[0]
        for rank, r in enumerate(got["rows"]):
            row = r[case]
            assert row["shape_ok"] and row["issued_as_said"], (world, rank, case, row)
            assert row["sent"] == row["wire_bytes"], (world, rank, case, row)
            if spec == "none":
                assert row["equals_torch"], (world, rank, case)
            else:
                assert row["max_err"] <= 1.1 * HALF_STEP[spec] * row["absmax"], (world, case, row)
            if case in ROW_TRACED:
                assert row["traced_equal"], (world, rank, case)
    sends_nothing = [r for r in got["rows"] if r[("int8", 7)]["rows_in"] == 0]
    assert len(sends_nothing) == (1 if world == 3 else 0)
    assert sends_nothing == [] or sends_nothing[0][("int8", 7)]["wire_bytes"] == 0


@pytest.mark.slow
def test_collectives_in_flight_together_do_not_mix(ranks):
    """Three collectives' phases interleaved on one group, as the graph pass places them (every
    issue, then the all-reduces' middle phases, then every wait): each result is what it is
    alone, on every rank."""
    _, got = ranks
    for r in got["interleaved"]:
        assert r["together"] == r["alone"]
    assert len({tuple(r["together"]) for r in got["interleaved"]}) == 1


@pytest.mark.slow
def test_a_nan_stays_in_its_block_on_every_rank(ranks):
    """One rank's NaN at element 10: its block of 256 (the first block of chunk 0) is NaN after
    both encodes, every other element is finite, and every rank has the same bits."""
    _, got = ranks
    rows = got["non_finite"]
    assert all(r["nan_at"] == list(range(256)) for r in rows), [r["nan_at"][:3] for r in rows]
    assert len({r["digest"] for r in rows}) == 1


@pytest.mark.slow
def test_int8_all_reduce_error_on_three_ranks(spawned):
    """Measured, printed (a figure for the issue): int8's relative L2 error on a Gaussian
    (192, 1000) summed over 3 ranks; the assertion only says it is lossy and the ranks agree."""
    rows = spawned["int8_error"]
    rel = rows[0]["rel_l2"]
    print(f"\nint8 all_reduce, 3 ranks, (192, 1000) fp32: relative L2 error {rel:.3e}, "
          f"{rows[0]['wire_bytes']} wire bytes vs {rows[0]['raw_bytes']} raw per rank")
    assert 0 < rel < 1e-2
    assert len({r["digest"] for r in rows}) == 1


# -- one process ----------------------------------------------------------------------------------


def _call(kind="all_reduce", shape=(8, 4), dtype=torch.float32, world=2, op="auto", **kw):
    if op == "auto":
        op = OP[kind]
    return CollectiveCall(kind, shape, dtype, world, op, **kw)


@pytest.mark.parametrize("call, spec, words", [
    (_call(op="max"), "int8", "'max' reduction"),
    (_call("reduce_scatter", op="min"), "int8", "'min' reduction"),
    (_call(dtype=torch.int64), "int8", "torch.int64 data"),
    (_call(world=1), "int8", "group of one"),
    (_call("all_to_all", input_splits=(3, 5)), "int8", "output split sizes missing"),
    (_call("all_to_all", output_splits=(2, 2, 4), world=3, shape=(9, 4)), "int8",
     "input split sizes missing"),
    (_call("all_to_all", input_splits=(3, 4), output_splits=(3, 5)), "int8",
     "do not add up to dim 0"),
    (_call("all_to_all", input_splits=(3, 5), output_splits=(3, 5)), "topk:ratio=0.25",
     "cannot encode each row of 4 elements on its own"),
    (_call("all_to_all", shape=(8, 0), input_splits=(3, 5), output_splits=(3, 5)), "int8",
     "rows of 0 elements"),
    (_call("reduce_scatter", shape=(5, 4), world=2), "int8", "does not split into 2"),
    (_call("all_gather", shape=()), "int8", "0-d input"),
    (_call(shape=(0, 4)), "int8", "empty tensor"),
    (_call(), "powersgd", "PowerSGD"),
    (_call(), "randomk:ratio=0.1", "keeps state besides its step"),
    (_call(dtype=torch.complex64), "int8", "complex64"),
])
def test_refuse_says_why(call, spec, words):
    why = refuse(call, spec)
    assert why is not None and words in why, why
    with pytest.raises(ConfigError, match="must run unchanged"):
        CompressedCollective(call, spec)


def test_refuse_symbolic_splits_only_where_they_do_not_add_up():
    import sympy

    s0 = sympy.Symbol("s0")
    assert "output split sizes missing" in refuse(_call("all_to_all", input_splits=(4, s0)),
                                                  "int8")
    assert "are not 2 sizes >= 0" in refuse(
        _call("all_to_all", input_splits=(s0,), output_splits=(4, 4)), "int8")
    assert refuse(_call("all_to_all", input_splits=(4, s0), output_splits=(s0, 4)), "int8") \
        is None


def test_symbolic_rows_are_priced_per_row_and_refuse_error_feedback():
    """Data-dependent split sizes (the router's counts read with ``.tolist()`` under
    ``capture_scalar_outputs``): dim 0 is a SymInt's expression. Each row is encoded on its
    own, so any row count works and the bytes are quoted per row; error feedback's residual
    has one entry per element, so it needs a fixed row count and is refused. A fixed dim 0
    with symbolic splits (a dispatch of a fixed number of tokens) keeps its per-call bytes and
    error feedback."""
    rows = _call("all_to_all", shape=("u0+u1", 16), input_splits=("u0", "u1"),
                 output_splits=("u2", "u3"))
    assert rows.by_rows and rows.symbolic_rows and rows.row_bytes == 64
    assert rows.out_shape == ("u2+u3", 16)
    cc = CompressedCollective(rows, "int8")
    assert cc.row_wire_bytes() == 16 + 4 and cc.state_layout() == {}
    with pytest.raises(ValueError, match="only known at run time"):
        cc.wire_bytes()
    with pytest.raises(ValueError, match="only known at run time"):
        rows.raw_bytes  # noqa: B018
    why = refuse(rows, "int4:ef")
    assert "error feedback needs a fixed row count" in why and "(u0+u1)" in why, why
    assert "use a codec without it ('int4')" in why
    assert refuse(rows, "fp8") is None and refuse(rows, "bf16") is None
    fixed = _call("all_to_all", shape=(8, 16), input_splits=("u0", "u1"),
                  output_splits=("u2", "u3"))
    assert fixed.by_rows and not fixed.symbolic_rows
    ef = CompressedCollective(fixed, "int4:ef")
    assert ef.wire_bytes() == 8 * ef.packing.nbytes // 2
    assert ef.state_layout() == {"residual": ((8 * 256,), torch.float32)}
    # what refuses any collective refuses these too; a symbolic row width is no row
    sym = {"input_splits": ("u0", "u1"), "output_splits": ("u2", "u3")}
    for call, words in [(_call("all_to_all", shape=("u0+u1", 16), dtype=torch.int64, **sym),
                         "torch.int64 data"),
                        (_call("all_to_all", shape=("u0", 16), world=1, input_splits=("u0",),
                               output_splits=("u1",)), "a group of one"),
                        (_call("all_to_all", shape=("u0+u1", "s1"), **sym), "symbolic shape")]:
        assert words in refuse(call, "int8"), (call, refuse(call, "int8"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["none", "int8", "int4:ef", "fp8", "topk:ratio=0.1,ef"])
def test_refuse_accepts(kind, spec):
    call = _call(kind, shape=(6, 5), world=3)
    assert refuse(call, spec) is None
    assert refuse(_call(kind, shape=(6, 5), world=3, input_splits=(2, 2, 2)), spec) is None
    assert refuse(_call(kind, shape=(6, 5), world=3, output_splits=()), spec) is None


def test_a_bad_spec_is_a_config_error_not_a_refusal():
    with pytest.raises(ConfigError, match="unknown codec"):
        refuse(_call(), "in8")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["none", "int8", "int4:ef", "topk:ratio=0.25"])
def test_traced_phases_issue_early_wait_late_and_send_wire_bytes(world, kind, spec):
    """The phases traced over FunctionalComm with fake tensors: phase 0 issues a collective and
    waits on none, the last phase waits and returns the collective's shape and dtype; the
    collectives' inputs add up to wire_bytes under the ring convention."""
    shape = (world * 3, 7) if kind in ("reduce_scatter", "all_to_all") else (5, 7)
    call = _call(kind, shape=shape, world=world)
    cc = CompressedCollective(call, spec)
    state = cc.init_state()
    x = torch.randn(shape)
    comm = w.CountingComm(FunctionalComm("unused", world))
    graphs = []
    from torch.fx.experimental.proxy_tensor import make_fx

    carry = []
    for phase in cc.phases:
        n_s = len(state)

        def fn(*flat, phase=phase, n_s=n_s):
            return list(phase(flat[0], list(flat[1:1 + n_s]), list(flat[1 + n_s:]), comm))

        gm = make_fx(fn, tracing_mode="fake")(x, *[state[k] for k in sorted(state)], *carry)
        graphs.append(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        carry = [torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in out]

    def ops(gm):
        return [str(n.target) for n in gm.graph.nodes if "c10d_functional" in str(n.target)]

    assert ops(graphs[0]) and not any("wait" in o for o in ops(graphs[0]))
    assert any("wait" in o for o in ops(graphs[-1]))
    assert len(graphs) == (3 if kind == "all_reduce" and spec != "none" else 2)
    assert tuple(carry[0].shape) == call.out_shape and carry[0].dtype == call.dtype
    assert comm.sent() == cc.wire_bytes()
    assert comm.issued == cc.messages()


class _Echo:
    """``world`` ranks that all hold the same input, in one process: an all-to-all hands this
    rank its own chunks back, an all-gather repeats the message ``world`` times."""

    def __init__(self, world):
        self.world = world

    def all_to_all(self, t):
        return t.clone()

    def all_gather(self, t):
        return t.reshape(-1).repeat(self.world)

    def wait(self, t):
        return t


def _encodes(cc) -> int:
    """How many ``ccfx_codecs.encode`` calls the first phase makes (traced with fake tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    state = cc.init_state()
    names = sorted(state)
    x = torch.randn(cc.call.shape)

    def fn(x, *st):
        return cc.phases[0](x, list(st), [], FunctionalComm("unused", cc.call.world))

    gm = make_fx(fn, tracing_mode="fake")(x, *[state[k] for k in names])
    return sum("ccfx_codecs.encode" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["int8", "int4:ef", "fp8", "bf16"])
def test_one_encode_for_every_chunk_gives_each_chunks_bits(kind, spec):
    """Where a chunk holds whole blocks (or the codec is a cast), every chunk is encoded and
    decoded in one call: the same result, bit for bit, as chunk by chunk (and with error
    feedback the same residuals), with one encode instead of W."""
    world = 3
    shape = (2, 256) if kind == "all_gather" else (world * 2, 256)
    call = _call(kind, shape=shape, world=world)
    rows, chunked = CompressedCollective(call, spec), CompressedCollective(call, spec, rows=False)
    assert rows.rows and not chunked.rows
    assert _encodes(rows) == 1 and _encodes(chunked) == (1 if kind == "all_gather" else world)
    x = torch.randn(shape)
    sr, sc = rows.init_state(), chunked.init_state()
    for _ in range(2):  # the second call starts from the first one's residuals
        a, b = rows.run(x, sr, _Echo(world)), chunked.run(x, sc, _Echo(world))
        assert torch.equal(a, b)
        assert a.shape == call.out_shape
    if spec.endswith(":ef") and kind != "all_gather":
        assert torch.equal(sr["residual"],
                           torch.cat([sc[f"chunk{j:04d}.residual"] for j in range(world)]))
    assert rows.wire_bytes() == chunked.wire_bytes()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["int8", "int4:ef"])
def test_chunks_padded_to_whole_blocks_give_each_chunks_bits(kind, spec):
    """Chunks of 10490 elements (40 blocks and 250 elements) are padded to 41 whole blocks so
    that one encode serves them all: the same result, bit for bit, as chunk by chunk with a
    partial last block (zeros change no block's absmax), for 6 more codes per chunk."""
    world = 3
    shape = {"all_reduce": (31469,), "all_gather": (10490,)}.get(kind, (world, 10490))
    call = _call(kind, shape=shape, world=world)
    padded, chunked = CompressedCollective(call, spec), CompressedCollective(call, spec, rows=False)
    assert (padded.used, padded.chunk, padded.rows) == (10490, 10496, True)
    assert (chunked.used, chunked.chunk, chunked.rows) == (10490, 10490, False)
    x = torch.randn(shape)
    sp, sc = padded.init_state(), chunked.init_state()
    for _ in range(2):
        assert torch.equal(padded.run(x, sp, _Echo(world)), chunked.run(x, sc, _Echo(world)))

    def message(m):  # codes (int8: a byte each, int4: half), 41 fp32 scales, to 4 bytes
        codes = m if spec == "int8" else -(-m // 2)
        return -(-(codes + 4 * 41) // 4) * 4

    rounds = 2 if kind == "all_reduce" else 1
    assert padded.wire_bytes() == rounds * (world - 1) * message(10496)
    assert chunked.wire_bytes() == rounds * (world - 1) * message(10490)


@pytest.mark.parametrize("kind, shape", [("all_reduce", ()), ("all_reduce", (2,)),
                                         ("all_gather", (1,)), ("reduce_scatter", (3,)),
                                         ("all_to_all", (3, 1))])
@pytest.mark.parametrize("spec", ["int8", "bf16", "topk:ratio=0.5"])
def test_fewer_elements_than_ranks(kind, shape, spec):
    """A scalar or a handful of elements over 3 ranks: chunks of one element (some all
    padding), the collective's shape back, finite values."""
    call = _call(kind, shape=shape, world=3)
    cc = CompressedCollective(call, spec)
    y = cc.run(torch.randn(shape), cc.init_state(), _Echo(3))
    assert y.shape == call.out_shape and y.dtype == call.dtype
    assert torch.isfinite(y).all()


def test_rows_only_where_the_codec_splits():
    assert not CompressedCollective(_call(shape=(6, 100), world=3), "int8").rows   # 200 / chunk
    assert not CompressedCollective(_call(shape=(6, 256), world=3), "topk:ratio=0.1").rows
    assert CompressedCollective(_call(shape=(5, 7), world=3), "bf16").rows
    with pytest.raises(ConfigError, match="in one call"):
        CompressedCollective(_call(shape=(6, 100), world=3), "int8", rows=True)


@pytest.mark.parametrize("kind, shape, world, raw", [
    ("all_reduce", (5, 7), 3, 187),        # 2 * 2 / 3 * 140 = 186.7, rounded up
    ("all_gather", (3, 5), 3, 120),        # 2 shards of 60 bytes
    ("reduce_scatter", (6, 5), 3, 80),     # 2 / 3 of 120
    ("all_to_all", (6, 3), 2, 36),         # 1 / 2 of 72
])
def test_raw_bytes_formula(kind, shape, world, raw):
    assert _call(kind, shape=shape, world=world).raw_bytes == raw
    assert CompressedCollective(_call(kind, shape=shape, world=world), "none").wire_bytes() == raw


def test_int8_all_reduce_sends_about_a_quarter():
    cc = CompressedCollective(_call(shape=(1024, 1024), world=4), "int8")
    # 2 (W-1) chunks of 2**18 int8 codes + 2**10 fp32 scales
    assert cc.wire_bytes() == 2 * 3 * (2 ** 18 + 4 * 2 ** 10)
    assert 0.25 < cc.wire_bytes() / cc.raw_bytes < 0.26


def test_state_is_per_chunk_and_the_owner_keeps_none_of_error_feedback():
    cc = CompressedCollective(_call(shape=(5, 7), world=3), "int4:ef")
    layout = cc.state_layout()
    assert layout == {f"chunk{j:04d}.residual": ((12,), torch.float32) for j in range(3)}
    assert {k: (tuple(v.shape), v.dtype) for k, v in cc.init_state().items()} == layout
    gather = CompressedCollective(_call("all_gather", shape=(5, 7), world=3), "int8:ef")
    assert gather.state_layout() == {"residual": ((35,), torch.float32)}
    # a stochastic codec: a step counter per chunk and one for the owner's encode
    names = sorted(CompressedCollective(_call(world=2), "qsgd").state_layout())
    assert names == ["chunk0000.step", "chunk0001.step", "owner.step"]


@pytest.mark.parametrize("numel", [1, 35, 257])
def test_packing_roundtrips_and_stays_aligned(numel):
    """int8's payload (n int8 codes, fp32 scales) packs scales first and pads the message to 4
    bytes: two messages back to back unpack as views."""
    from ccfx.codecs import ops
    from ccfx.wire.collectives import _Packing

    layout = CompressedCollective(_call("all_gather", shape=(numel,)), "int8").packing.layout
    p = _Packing.of(layout)
    assert p.nbytes % 4 == 0 and p.nbytes - (numel + 4 * -(-numel // 256)) < 4
    xs = [torch.randn(numel), torch.randn(numel)]
    payloads = [ops.encode(x, "int8", [])[0] for x in xs]
    buf = torch.cat([p.pack(list(pl)) for pl in payloads])
    for k, pl in enumerate(payloads):
        got = p.unpack(buf, k * p.nbytes)
        assert all(torch.equal(a, b) for a, b in zip(got, pl))


def test_local_comm_is_the_identity():
    t = torch.randn(4, 3)
    comm = LocalComm()
    assert comm.wait(comm.all_to_all(t)) is t
    assert comm.wait(comm.reduce_scatter(t)) is t


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="collective kind 'broadcast'"):
        refuse(CollectiveCall("broadcast", (4,), torch.float32, 2), "int8")


# -- unequal all_to_all splits: whole rows ---------------------------------------------------------


class LoopbackComm:
    """One rank's view of a group whose split matrix is symmetric and whose every rank holds the
    same rows: what comes back is what was sent (plain torch, traceable without a group)."""

    world = 2

    def all_to_all(self, t, output_splits=None, input_splits=None):
        assert list(output_splits) == list(input_splits)
        return t.clone()

    def wait(self, t):
        return t


def _row_round_trip(x: torch.Tensor, spec: str) -> torch.Tensor:
    """Each row of ``x`` through the codec on its own (its own encode and decode)."""
    out = []
    for row in x:
        payload, _ = torch.ops.ccfx_codecs.encode(row, spec, [])
        got, _ = torch.ops.ccfx_codecs.decode(list(payload), spec, [row.numel()], row.dtype, [])
        out.append(got.view(row.shape))
    return torch.stack(out)


def test_unequal_splits_are_rows_sized_from_the_splits():
    call = _call("all_to_all", shape=(8, 300), input_splits=(3, 5), output_splits=(6, 0))
    assert call.by_rows and call.row == 300 and call.out_shape == (6, 300)
    assert not _call("all_to_all", shape=(8, 3), input_splits=(4, 4), output_splits=(4, 4)).by_rows
    assert not _call("all_to_all", shape=(8, 3), input_splits=(4, 4)).by_rows  # the other: equal
    cc = CompressedCollective(call, "int8")
    # a row of 300 is encoded padded to 2 blocks (512); its 300 codes and 2 scales travel
    assert cc.row_padded == 512 and cc.packing.nbytes == 300 + 2 * 4
    assert cc.messages() == [("all_to_all", 8 * 308)]
    assert cc.wire_bytes() == 8 * 308 // 2 and call.raw_bytes == 8 * 300 * 4 // 2
    assert cc.state_layout() == {}
    ef = CompressedCollective(call, "int8:ef")
    assert ef.state_layout() == {"residual": ((8 * 512,), torch.float32)}
    # a rank that sends no rows: nothing to encode, and the same decision as its peers
    empty = _call("all_to_all", shape=(0, 300), input_splits=(0, 0), output_splits=(3, 6))
    assert refuse(empty, "int8") is None and CompressedCollective(empty, "int8").wire_bytes() == 0


@pytest.mark.parametrize("spec, row", [("int8", 7), ("int8", 300), ("int4", 7), ("fp8", 256),
                                       ("bf16", 5)])
def test_each_row_decodes_as_if_encoded_alone(spec, row):
    """One encode of every row (padded to whole blocks where needed, only the real codes
    sent, the padding restored before one decode) gives each row's own round trip bit for bit,
    eagerly and traced, with a split of 0 rows."""
    from .wire_collectives_workers import traced_phases

    x = torch.randn(9, row, generator=torch.Generator().manual_seed(row))
    call = _call("all_to_all", shape=(9, row), input_splits=(9, 0), output_splits=(9, 0))
    cc = CompressedCollective(call, spec)
    want = _row_round_trip(x, spec)
    assert torch.equal(cc.run(x, {}, LoopbackComm()), want)
    _, traced = traced_phases(cc, LoopbackComm(), x, [])
    assert torch.equal(traced, want)
    assert not torch.equal(want, x)  # the codec really ran


def test_the_pass_compresses_an_all_to_all_of_data_dependent_rows():
    """Split sizes and dim 0 unbacked SymInts: the pass takes the split sizes as inputs of the
    traced phases and the compressed graph, compiled once, runs any row count (0 included),
    each row through the codec on its own: the rows' round trip, bit for bit."""
    from ccfx.passes.compress_collectives import Rewrite, compress_collectives, find_collectives

    f = torch.ops._c10d_functional

    def fn(x, counts):
        rows, a, b = unbacked_rows(x, counts)
        return f.wait_tensor(f.all_to_all_single(rows * 2, [a, b], [a, b], "fake")) + 1

    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    gm = traced_with_unbacked_sizes(fn, x, torch.tensor([3, 4]))
    (found,) = find_collectives(gm, lambda _: 2)
    assert not found.problem and found.shape == ("u0+u1", 16) and found.call.symbolic_rows
    assert (found.input_splits, found.output_splits) == (("u0", "u1"), ("u0", "u1"))
    assert found.agreed_shape == ["rows", 16]
    cc = CompressedCollective(found.call, "int8")
    out = compress_collectives(gm, [found], [Rewrite(0, "int8", "", cc, {})],
                               comm_for=lambda name, world: LoopbackComm())
    assert not [n for n in out.graph.nodes if n.target is f.all_to_all_single.default]
    for a, b in [(3, 4), (5, 4), (0, 0), (0, 2)]:
        got = out(x, torch.tensor([a, b]))
        assert got.shape == (a + b, 16)
        want = _row_round_trip(x[:a + b] * 2, "int8") + 1 if a + b else torch.ones(0, 16)
        assert torch.equal(got, want)
        # eagerly, the phases bound to the sizes give the same bits
        eager = cc.bind((a, b), (a, b)).run(x[:a + b] * 2, {}, LoopbackComm()) + 1
        assert torch.equal(got, eager)


def test_the_pass_compresses_an_unequal_all_to_all_and_agrees_without_its_splits():
    from torch.fx.experimental.proxy_tensor import make_fx

    from ccfx.passes.compress_collectives import (
        Rewrite,
        agreed_code,
        compress_collectives,
        find_collectives,
    )

    f = torch.ops._c10d_functional

    def fn(x):
        return f.wait_tensor(f.all_to_all_single(x * 2, [3, 0], [3, 0], "fake")) + 1

    x = torch.randn(3, 16)
    gm = make_fx(fn, tracing_mode="fake")(x)
    (found,) = find_collectives(gm, lambda _: 2)
    assert (found.input_splits, found.output_splits) == ((3, 0), (3, 0)) and not found.problem
    assert found.agreed_shape == ["rows", 16]
    assert "[splits], [splits]" in agreed_code(gm.code) and "[3, 0]" not in agreed_code(gm.code)
    cc = CompressedCollective(found.call, "int8")
    out = compress_collectives(gm, [found], [Rewrite(0, "int8", "", cc, {})],
                               comm_for=lambda name, world: LoopbackComm())
    assert not [n for n in out.graph.nodes if n.target is f.all_to_all_single.default]
    assert torch.equal(out(x), _row_round_trip(x * 2, "int8") + 1)
