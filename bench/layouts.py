"""Every 4-rank layout of a ≥ 10 M-parameter GPT on two "nodes" joined by a slow link (#19).

The heterogeneous harness of DESIGN.md (:func:`bench.shaped.two_nodes`): two network
namespaces, two ranks in each; inside a node the ranks talk over its loopback (34 Gbit/s
measured), across over a veth pair limited by tc tbf (``--mbit``, 50 by default: 48.1 Mbit/s
measured). Which ranks sit on which node is the layout's placement. The model is ccfx's GPT at
width 384, 6 blocks, context 64 (10.7 M parameters), on the bundled corpus, AdamW; every layout
trains the same global batch (``--batch`` samples per step, split over the replicas) in
``--microbatches`` microbatches under torch's 1F1B, the way ``ccfx run`` does
(``ccfx.build_stages`` on a ``(dp, pp)`` mesh, ``ccfx.sync_grads`` after the schedule).

Layouts (pp × dp, and where the slow link falls):

  pp1-dp4            data parallel over all four: the gradient all-reduce crosses the link
  pp2-dp2-dp-across  each pipeline inside a node, each stage's replicas across (buckets cross)
  pp2-dp2-pp-across  each pipeline across the nodes (its one hop crosses), replicas inside
  pp4-dp1            one pipeline over all four: hop 1→2 crosses, 0→1 and 2→3 stay inside

each with codecs ``none`` and, with ``--codecs``, others (``int8`` on every hop and bucket,
``auto`` planned on the cluster the harness is: ``ccfx.Cluster.nodes(2, 2, ...)``).

Per layout: the steady step (the slowest rank's, median over ``--steps`` timed steps after
``--warmup``), the loss at the last step (same data in every layout: a sanity check, not a
result), and per rank two memory figures: the peak of live tensor bytes during one step
(:func:`tensor_peak`, PyTorch's MemTracker: what ``torch.cuda.max_memory_allocated`` is on a
GPU, and what the planner predicts), and the peak resident memory during another step above
the rank's resident memory once its stages were built, the rest of the model dropped and the
heap trimmed, plus its stage's parameters (Linux VmHWM), with what separates the two
(:func:`rss_gap`: allocator slack, malloc'd memory that is no tensor, code paged in, Python's
arenas and stacks). The ranks compile the stages the planner priced (``split_points`` from
``make_layout``). Ratios are against the best layout of the same
run. With the layout planner (``ccfx.plan_parallel``) present, its predicted step and memory
stand beside each measured one, and ``ccfx.plan_parallel``'s own choice on the harness's
cluster is printed after the table (``--predict-only``: the planner's side alone, no ranks).

    python -m bench.layouts                               # 50 Mbit/s, codecs none
    python -m bench.layouts --codecs none int8 --steps 6
    python -m bench.layouts --layouts pp4-dp1 --mbit 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench import common
from bench.shaped import (
    RankFailed,
    RankTimeout,
    ShapingUnavailable,
    exit_cleanly_on_sigterm,
    run_ranks,
    two_nodes,
)

#: layout → (pp, dp, node of each rank); the mesh is (dp, pp): rank = replica * pp + stage.
LAYOUTS = {
    "pp1-dp4": (1, 4, [0, 0, 1, 1]),
    "pp2-dp2-dp-across": (2, 2, [0, 0, 1, 1]),
    "pp2-dp2-pp-across": (2, 2, [0, 1, 0, 1]),
    "pp4-dp1": (4, 1, [0, 0, 1, 1]),
}
MODEL = {"block_size": 64, "n_layer": 6, "n_head": 6, "n_embd": 384}
VOCAB = 96  # the bundled corpus's characters (CharTokenizer)
INSIDE_GBPS = 34.0  # the loopback inside a node, measured by bench.shaped --selftest --two-nodes
#: what TCP gets through the tbf-limited pair: 48.1 Mbit/s measured at ``--mbit 50``
ACROSS_EFFICIENCY = 48.1 / 50


def harness_cluster(mbit: float, flops: float | None = None):
    """The harness as a ccfx cluster description: 2 nodes × 2 devices, the measured links;
    ``flops`` each rank's compute rate (None: "measure here")."""
    import ccfx

    return ccfx.Cluster.nodes(2, 2, intra=(INSIDE_GBPS, 0.05),
                              inter=(mbit * ACROSS_EFFICIENCY / 1000, 0.05),
                              memory="24GiB", flops=flops)


def devices_of(placement: list[int]) -> list[str]:
    """Each rank's device name: rank r on the next free device of node ``placement[r]``."""
    free = {0: ["n0.d0", "n0.d1"], 1: ["n1.d0", "n1.d1"]}
    return [free[n].pop(0) for n in placement]


def cluster_dict(mbit: float, placement: list[int]) -> dict:
    """The cluster the ranks plan ``auto`` on, its devices in rank order."""
    return harness_cluster(mbit).select(devices_of(placement)).to_dict()


def predictions(args) -> tuple[dict, str]:
    """The layout planner's predicted step and per-rank memory of every (layout, codec) this
    bench measures, and the layout ``ccfx.plan_parallel`` chooses, on the harness's cluster.
    The model is timed here on one thread; the four ranks share this machine's cores."""
    import os
    from dataclasses import replace

    import torch

    from ccfx.backends.plan_parallel import model_facts, plan_parallel
    from ccfx.models import GPTConfig, TinyGPT
    from ccfx.planner.codec_cost import CodecTimer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        cluster = harness_cluster(args.mbit)  # every device "measure here"
        model = TinyGPT(GPTConfig(vocab_size=VOCAB, **MODEL))
        x = torch.randint(0, VOCAB, (args.batch, MODEL["block_size"]))
        # the model timed here on one thread (forward, backward, AdamW:
        # ccfx.planner.compute.measure_model), the four ranks sharing this machine's cores
        # (ccfx.planner.compute.contention: a pipeline's warm-up and drain leave cores free)
        facts = model_facts(model, (x,), measure=True)
        if facts.measured is None:
            raise SystemExit("bench.layouts: the model could not be timed here")
        facts = replace(facts, measured=replace(facts.measured,
                                                cores=min(os.cpu_count() or 1, 4)))
        timer = CodecTimer()  # codecs timed on one thread too, at the real sizes
        out = _predict(args, facts, cluster, timer)
        best = plan_parallel(facts, (x,), cluster, microbatches=[args.microbatches],
                             tensor_parallel=False, local_steps=False, timer=timer)
    finally:
        torch.set_num_threads(threads)
    return out, best.explain()


def _predict(args, facts, cluster, timer) -> dict:
    from ccfx.planner.layout import predict_layout
    from ccfx.planner.layout_search import make_layout

    out = {}
    for name in args.layouts:
        pp, dp, placement = LAYOUTS[name]
        for codec in args.codecs:
            if codec == "auto":
                continue
            fwd, bwd, grads = split_codec(codec, args)
            layout = make_layout(facts, cluster, pp, dp, microbatches=args.microbatches,
                                 devices=devices_of(placement), activation_codec=fwd,
                                 activation_grad_codec=bwd,
                                 gradient_codec=grads if dp > 1 else "none")
            p = predict_layout(facts, cluster, layout, timer=timer)
            out[(name, codec)] = {"step_s": p.step_s, "breakdown": p.breakdown(),
                                  "memory": [m.total for m in p.memory],
                                  "memory_parts": [m.describe() for m in p.memory],
                                  "split": [facts.layers[b].name
                                            for b in layout.boundaries[1:]]}
    return out


def _log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def split_codec(codec: str, args=None) -> tuple[str, str, str]:
    """A row's codecs ``fwd[/bwd[/gradients]]`` (e.g. ``int8/int4:ef/none``, what
    ``ccfx.plan_parallel`` chose): the hops' forward and backward and the gradient buckets'
    (default: ``--gradient-codec``, else the forward's)."""
    parts = codec.split("/")
    fwd = parts[0]
    bwd = parts[1] if len(parts) > 1 else fwd
    grads = parts[2] if len(parts) > 2 else getattr(args, "gradient_codec", None) or fwd
    return fwd, bwd, grads


def train_rank(rank: int, world: int, *, pp: int, dp: int, codec: str, batch: int,
               microbatches: int, steps: int, warmup: int, cluster: dict, memory: bool = True,
               seed: int = 0, gradient_codec: str | None = None,
               split_points: list[str] | None = None) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    import ccfx

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    options = _options(codec, pp, dp, microbatches, cluster, gradient_codec, split_points)
    # _first: the batch the stages were compiled on, live (the tensor figures count it)
    stages, stream, _first = _build_rank(mesh, options, batch, microbatches, seed)
    # the baseline of the memory figure: this rank's resident bytes now, the other stages'
    # weights and the compile's transients freed and handed back to the OS, less its own
    # stage's parameters (they are part of what the planner predicts)
    import gc

    gc.collect()
    _malloc_trim()
    own = sum(p.numel() * p.element_size() for s in stages for p in s.submod.parameters())
    base = _memory_base(own)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    sched = Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    first, last = stages[0].is_first, stages[-1].is_last

    def step() -> float | None:
        x, y = next(stream)
        losses: list = []
        opt.zero_grad(set_to_none=True)
        sched.step(*((x,) if first else ()), target=y if last else None,
                   losses=losses if last else None)
        ccfx.sync_grads(stages)
        opt.step()
        return sum(float(v) for v in losses) / len(losses) if last else None

    common.run_steps(lambda i: step(), warmup, say=lambda i, _: _log(rank, f"warm-up step {i}"))
    peak = _peak_memory(step, base, stages, opt) if memory else "not measured"
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
    losses, times = common.time_steps(
        lambda _: step(), steps, prepare=lambda i: dist.barrier(),
        say=lambda i, _, s: _log(rank, f"timed step {i}: {s:.3f} s"))
    slowest = [None] * world
    dist.all_gather_object(slowest, times)
    return {"step_s": statistics.median(common.slowest_per_step(slowest)),
            "loss": losses[-1] if losses else None, "peak_bytes": peak,
            "params": sum(p.numel() for p in params),
            "param_grad_opt_bytes": 2 * sum(p.numel() * p.element_size() for p in params)
            + state}


def _options(codec: str, pp: int, dp: int, microbatches: int, cluster: dict,
             gradient_codec: str | None, split_points: list[str] | None) -> dict:
    """A row's compile options: its codecs (``split_codec``; ``auto`` planned on ``cluster``),
    and the stages the planner priced when it gave them (its memory is per stage)."""
    fwd_codec, bwd_codec, grads = split_codec(codec, argparse.Namespace(
        gradient_codec=gradient_codec))
    options = {"stages": pp, "activation_codec": fwd_codec, "activation_grad_codec": bwd_codec,
               "gradient_codec": grads if dp > 1 else "none",
               "lowering": "eager"}
    if codec == "auto":
        options.update(cluster=cluster, microbatches=microbatches, pipeline_schedule="1F1B")
    if split_points and pp > 1:  # the stages the planner priced (its memory is per stage)
        options["split_points"] = tuple(split_points)
    return options


def _build_rank(mesh, options: dict, batch: int, microbatches: int, seed: int):
    """This rank's stages on the (dp, pp) ``mesh``, the whole model compiled with ``options``
    at the microbatch shape and then dropped; its replica's batches, and the first of them
    (the compile's)."""
    import torch

    import ccfx
    from ccfx.models import CharTokenizer, GPTConfig, TinyGPT, batches, load_corpus

    dp = mesh.size(0)
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    text = load_corpus()
    tok = CharTokenizer(text)
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab_size=tok.vocab_size, **MODEL))
    stream = batches(tok.encode(text), batch // dp, MODEL["block_size"], 1000 * seed + dp_rank)
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options=options)
    first = next(stream)
    compiled(first[0].chunk(microbatches)[0])
    stages = ccfx.build_stages(compiled, pp_rank, "cpu", mesh.get_group("pp"),
                               dp_group=mesh.get_group("dp") if dp > 1 else None)
    return stages, stream, first


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): freed heap pages back to the OS, so RSS counts live memory."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _mallinfo() -> dict[str, int]:
    """glibc's mallinfo2: ``arena`` (heap bytes from brk/arenas), ``hblkhd`` (mmapped chunks),
    ``uordblks`` (in use in the heap), ``fordblks`` (free in the heap, kept by malloc)."""
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
             "uordblks", "fordblks", "keepcost")

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names]

    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    f.restype = Info
    got = f()
    return {n: int(getattr(got, n)) for n in ("arena", "hblkhd", "uordblks", "fordblks")}


def _process_memory() -> dict[str, int]:
    """Resident bytes by kind (Linux /proc/self/status) and malloc's heap (mallinfo2)."""
    return {**{k: _rss_kib(k) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")},
            "threads": _rss_kib("Threads"), **_mallinfo()}


def _memory_base(own_param_bytes: int) -> dict:
    """The baseline of the resident figure, taken after ``build_stages`` with the whole model
    dropped and the heap trimmed: this rank's resident bytes less its stage's parameters
    (they are part of what the planner predicts)."""
    base = _process_memory()
    base["rss_base"] = base["VmRSS"] - own_param_bytes
    base["params"] = own_param_bytes
    base["tensors"] = sum(t.untyped_storage().nbytes() for t in _live_tensors())
    return base


def _live_tensors() -> list:
    """One tensor per live CPU storage that Python can reach (gc), real tensors only (the
    compile leaves fake ones in its graphs' metadata)."""
    import gc

    import torch

    seen, out = set(), []
    for o in gc.get_objects():
        # type(), not isinstance: a weakref.proxy among the objects (the codecs keep some)
        # raises ReferenceError on isinstance once its referent is gone
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
            try:
                st = o.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (fake, functional): no bytes
                continue  # a fake or functional tensor
            if ptr not in seen and st.nbytes():
                seen.add(ptr)
                out.append(o)
    return out


def tensor_peak(step, stages, opt) -> dict:
    """The peak of live tensor bytes during one ``step()`` (what
    ``torch.cuda.max_memory_allocated`` reports on a GPU), measured by PyTorch's
    ``torch.distributed._tools.MemTracker``, which counts every tensor an op makes and
    watches its storage die, gloo's and the wire's buffers included (they are tensors).

    Two things make it work inside a pipeline step: the stage module runs once per
    microbatch, which MemTracker takes for a second iteration (NotImplementedError "multiple
    iterative calls" at the second microbatch's forward, its peer ranks then wait in their
    receive: the "hang"), so its module statistics are reset before each microbatch's
    forward; and what lives before the step (parameters, AdamW's state, torch's receive
    buffers, codec state) is registered first (``track_external``: every tensor gc reaches,
    then the modules and the optimizer so they are labelled). Returns the peak, the bytes
    live at the start, and the peak's parts by MemTracker's labels."""
    import gc

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    opt.zero_grad(set_to_none=True)
    gc.collect()
    live = _live_tensors()
    tracker = MemTracker()
    tracker.track_external(*live)
    tracker.track_external(*[s.submod for s in stages], opt)
    del live
    cpu = torch.device("cpu")
    start = tracker.get_tracker_snapshot()[cpu]["Total"]
    originals = []
    for s in stages:
        originals.append(s.forward_one_chunk)

        def forward(*a, _run=s.forward_one_chunk, **k):
            tracker.reset_mod_stats()
            return _run(*a, **k)

        s.forward_one_chunk = forward
    try:
        with tracker:
            step()
    finally:
        for s in stages:
            del s.forward_one_chunk  # the class's method again
    peak = tracker.get_tracker_snapshot("peak")[cpu]
    return {"tensor": int(peak["Total"]), "tensor_start": int(start),
            "parts": {str(k).split(".")[-1]: int(v) for k, v in peak.items()
                      if v and k != "Total"}}


def _peak_memory(step, base: dict, stages, opt) -> dict | str:
    """This rank's memory during a step, two figures: the peak of live tensor bytes
    (:func:`tensor_peak`, one step; what the planner predicts), and the peak resident bytes
    (another step: Linux VmHWM, reset through /proc/self/clear_refs) above ``base``
    (:func:`_memory_base`), and the resident figure less the tensor peak in parts that add up
    to it (:func:`rss_gap`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        return f"cannot reset the peak: {e}"
    step()
    end = _process_memory()
    end["tensors"] = sum(t.untyped_storage().nbytes() for t in _live_tensors())
    out = {"rss": end["VmHWM"] - base["rss_base"]}
    out.update(tensor_peak(step, stages, opt))
    out["rss_gap"] = rss_gap(base, end, out["tensor"])
    return out


def rss_gap(base: dict, end: dict, tensor_peak: int) -> dict[str, int]:
    """The resident figure (VmHWM − (VmRSS at the baseline − the stage's parameters)) less
    the tensor peak, in parts taken at the step's end, which add up to it exactly: the
    heap's size at the peak is its size at the end plus what it returned to the OS since.

    * allocator slack: free space in malloc's heap at the peak beyond the baseline's (pages
      touched by earlier steps' allocations, kept by malloc, not live at the peak):
      Δ free + returned − (tensor peak − tensors live at the end);
    * malloc'd, not tensors: Δ (bytes malloc has in use − live tensor bytes): gloo's and
      the schedule's own buffers, Python objects above 512 bytes, autograd's metadata;
    * file pages: Δ RssFile, code and libraries first run since the baseline;
    * other anonymous memory: Δ RssAnon − Δ malloc heap: Python's small-object arenas,
      thread stacks, other mappings;
    * tensors in the baseline: live tensors at the baseline other than the stage's
      parameters (the data set, the example batch), counted in the tensor peak but not in
      the resident figure (negative).

    mallinfo2 counts the heap's address space, not its resident pages (malloc gives free
    pages back inside an arena with MADV_DONTNEED): the split between allocator slack and
    other anonymous memory is loose (one rank of bench.layouts showed slack -27 MiB, other
    +52 MiB); their sum, memory the allocator and runtime hold that no tensor uses at the
    peak, is exact."""
    if "fordblks" not in end:
        return {}
    heap = {k: d["arena"] + d["hblkhd"] for k, d in (("base", base), ("end", end))}
    nontensor = {k: d["uordblks"] + d["hblkhd"] - d["tensors"]
                 for k, d in (("base", base), ("end", end))}
    returned = end["VmHWM"] - end["VmRSS"]
    return {
        "allocator slack": end["fordblks"] - base["fordblks"] + returned
        - (tensor_peak - end["tensors"]),
        "malloc'd, not tensors": nontensor["end"] - nontensor["base"],
        "file pages": end["RssFile"] - base["RssFile"],
        "other anonymous": end["RssAnon"] - base["RssAnon"] - (heap["end"] - heap["base"]),
        "tensors in the baseline": -(base["tensors"] - base["params"]),
    }


def planner_split(pp: int, dp: int, placement: list[int], args) -> list[str] | None:
    """The stage boundaries the planner prices for this layout (``make_layout``'s, as
    ``ccfx.plan_parallel``'s options give them), as the compile's ``split_points``: the ranks
    run the stages whose memory and time are predicted (ccfx's own split of 4 stages
    differs). None without the planner."""
    if pp == 1:
        return None
    try:
        import torch

        from ccfx.backends.plan_parallel import model_facts
        from ccfx.models import GPTConfig, TinyGPT
        from ccfx.planner.layout_search import make_layout
    except ImportError:
        return None
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, **MODEL))
    facts = model_facts(model, (torch.zeros(args.batch, MODEL["block_size"], dtype=torch.long),))
    layout = make_layout(facts, harness_cluster(args.mbit, flops=1e11), pp, dp,
                         microbatches=args.microbatches, devices=devices_of(placement))
    return [facts.layers[b].name for b in layout.boundaries[1:]]


def run_layout(name: str, codec: str, args) -> dict:
    pp, dp, placement = LAYOUTS[name]
    with two_nodes(args.mbit) as nodes:
        netns, env = nodes.launch(placement)
        res = run_ranks("bench.layouts", "train_rank", 4,
                        {"pp": pp, "dp": dp, "codec": codec, "batch": args.batch,
                         "gradient_codec": args.gradient_codec,
                         "microbatches": args.microbatches, "steps": args.steps,
                         "warmup": args.warmup, "cluster": cluster_dict(args.mbit, placement),
                         "memory": not args.no_memory,
                         "split_points": planner_split(pp, dp, placement, args)},
                        netns=netns, rank_env=env, timeout_s=args.timeout, stall_s=240)
    return {"layout": name, "codec": codec, "pp": pp, "dp": dp, "placement": placement,
            "step_s": res[0]["step_s"], "loss": next(r["loss"] for r in res if r["loss"]),
            "peak_bytes": [r["peak_bytes"] for r in res], "params": sum(
                r["params"] for r in res[:pp])}


def _table(rows: list[dict]) -> str:
    ok = [r for r in rows if "step_s" in r]
    best = min((r["step_s"] for r in ok), default=None)
    table = []
    for r in rows:
        if "step_s" not in r:
            table.append([r["layout"], r["codec"], "failed", "", "", "", r["failed"][:60]])
            continue
        p = r.get("predicted")
        table.append([r["layout"], r["codec"], f"{r['step_s']:.3f}", f"{r['step_s'] / best:.2f}",
                      f"{p['step_s']:.3f} ({p['step_s'] / r['step_s'] - 1:+.0%})" if p else "",
                      f"{r['loss']:.4f}", _memory_cells(r, p), _rss_cells(r)])
    return common.table(table, ["layout", "codec", "step s", "vs best", "predicted (err)",
                                "loss", "tensor peak MiB per rank: measured / predicted (err)",
                                "resident MiB per rank (above the baseline)"])


def _memory_cells(r: dict, p: dict | None) -> str:
    """Per rank (rank = replica × pp + stage): the measured tensor peak, the planner's
    estimate for its stage, the error."""
    cells = []
    for rank, b in enumerate(r["peak_bytes"]):
        got = b.get("tensor") if isinstance(b, dict) else None
        want = p["memory"][rank % r["pp"]] if p else None
        if got is None:
            cells.append("?" if want is None else f"? / {want / 2**20:.0f}")
        elif want is None:
            cells.append(f"{got / 2**20:.0f}")
        else:
            cells.append(f"{got / 2**20:.0f} / {want / 2**20:.0f} ({want / got - 1:+.1%})")
    return ", ".join(cells)


def _rss_cells(r: dict) -> str:
    return " ".join(f"{b['rss'] / 2**20:.0f}" if isinstance(b, dict) else "?"
                    for b in r["peak_bytes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--mbit", type=float, default=50.0, help="the link between the nodes")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--codecs", nargs="+", default=["none"])
    ap.add_argument("--gradient-codec", default=None,
                    help="the gradient buckets' codec (default: each row's codec)")
    ap.add_argument("--batch", type=int, default=32, help="samples per step, all replicas")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip the memory step")
    ap.add_argument("--predict-only", action="store_true",
                    help="print the planner's predictions without running the ranks")
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    rows = []
    if a.predict_only:
        predicted, chosen = predictions(a)
        for (name, codec), p in predicted.items():
            print(f"{name:>18} {codec:>5}: {p['step_s']:.3f} s ({p['breakdown']}), memory per "
                  f"stage MiB {[round(m / 2**20) for m in p['memory']]}")
        print(chosen)
        return 0
    for name in a.layouts:
        for codec in a.codecs:
            print(f"== {name} codec {codec}", flush=True)
            try:
                rows.append(run_layout(name, codec, a))
            except (RankFailed, RankTimeout, ShapingUnavailable) as e:
                reason = getattr(e, "reason", str(e).splitlines()[0])
                rows.append({"layout": name, "codec": codec, "failed": reason})
            print(json.dumps(rows[-1]), flush=True)
    predicted, chosen = predictions(a)
    for r in rows:
        r["predicted"] = predicted.get((r["layout"], r["codec"]))
    print(_table(rows))
    print("\nccfx.plan_parallel on the harness's cluster (pipeline x data parallel):\n" + chosen)
    common.write_json(a.json, "layouts", {"mbit": a.mbit, "rows": rows, "plan": chosen})
    return 0


if __name__ == "__main__":
    sys.exit(main())
