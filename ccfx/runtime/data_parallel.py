"""Data parallel: one model's gradient synchronization, owned by its backend.

``options={"data_parallel": True, "gradient_codec": ...}`` makes every rank of the default
process group run the whole model and average parameter gradients from inside the compiled
backward (``passes.grad_buckets``); there is no DDP wrapper. This object holds what that needs
for one compiled model:

* per graph, a process group of its own over every rank (:func:`ccfx.wire.agree.group`),
  named by the fingerprint of the graph, the options, the bucket plan and the ranks
  (``ccfx-<fingerprint>``, never a count of the groups a process made before), with
  ``collective_timeout_s`` as its timeout, so a dead or diverged peer in the middle of training
  becomes an error within that time instead of a hang. The backward names it when it compiles;
  the ranks make it (after agreeing on the fingerprint) where they first need it: the first
  call's broadcast, else the first backward. A graph compiled on some ranks only (an eval copy,
  a rank-0-only evaluation that recompiles) never makes it, so never waits for the others;
  without a process group, world size 1 (codecs as local round trips), and the plan says so;
* per graph, the buckets (recorded in the plan, each with its collective: ``gradient_collective``
  "ring" or "all_gather" for non-summable codecs, "auto" resolved per bucket by
  :func:`ccfx.wire.link.choose_collective`) and their codec state, which lives in
  :attr:`state` (an ``nn.Module`` of buffers, ``ccfx.codec_state(compiled)``) so a checkpoint
  resumes with identical numerics;
* the first call's broadcast of parameters and buffers from rank 0 on the graph's own group
  (as DDP does; afterwards, with ``broadcast_buffers`` (default True, DDP's default), every
  forward with grad enabled broadcasts the buffers, such as BatchNorm statistics, from rank 0
  again; False keeps them per rank, as DDP with ``broadcast_buffers=False``): once per tensor (a recompile of the same model broadcasts
  nothing), and not for a graph compiled under ``no_grad`` (no gradients to synchronize: an
  evaluation communicates nothing);
* ``gradient_codec="auto"``: the codec of each bucket comes from ``decide_codecs``, the
  planner's pricing handed in by the backend (the compile layer is the only caller of the
  planner): rank 0 calls it and every rank takes its answer (:func:`ccfx.wire.agree.from_rank0`,
  keyed by the fingerprint of the backward's buckets and options);
* the step count that ends ``warmup_steps`` (an uncompressed variant of the backward runs
  until then), and the ledger rows of each bucket every time a backward runs;
* the fingerprint agreement before the group is made: ranks whose graphs, bucket plans or
  options differ fail with a clear error naming both fingerprints and what differs, before
  their first collective (gloo would abort, hang, or pair different tensors otherwise).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from .. import _torch_compat as tc
from .. import codecs
from ..codecs.state import CodecState, bucket_channel
from ..config import AUTO, Config
from ..errors import CollectiveError, ConfigError
from ..errors import first_line as _first_line
from ..passes.grad_buckets import find_param_grads, grad_buckets
from ..passes.graph_utils import copy_graph, device_of
from ..plan import Bucket, DataParallelInfo
from ..wire import agree
from ..wire.comm import FunctionalComm, LocalComm
from ..wire.exchange import exchange_for
from ..wire.link import Link, configured_link, resolve_collective
from ..wire.policy import assign_buckets
from ..wire.world import dist as _dist
from .launcher_env import require_group_under_launcher
from .ledger import Ledger

log = logging.getLogger("ccfx")

#: ``decide_codecs(backward_gm, buckets, config, world) -> (choice, decisions, prediction)``:
#: ``gradient_codec="auto"``'s codec per bucket index (the backend passes the planner's
#: :func:`ccfx.planner.plan_buckets.plan_bucket_codecs`).
DecideCodecs = Callable[..., tuple]


@dataclass
class _GraphState:
    param_names: dict[int, str]  # forward input index -> parameter name
    sync_inputs: list[int]  # parameters and buffers broadcast from rank 0 at the first call
    synced: bool = False
    backward_calls: int = 0
    collectives: int = 0  # gradient collective steps entered on its group (agree.entering)
    shapes: list | None = None  # its inputs' shapes at its first call
    buckets: list = field(default_factory=list)
    decisions: list = field(default_factory=list)  # what gradient_codec="auto" chose
    prediction: object = None  # and the step it predicted (a ccfx.plan.Prediction)
    desc: dict = field(default_factory=dict)  # the graph (and options) it was compiled for
    agreed: dict = field(default_factory=dict)  # what the ranks agree on: desc and buckets
    group_name: str | None = None  # its process group's name, from the fingerprint of agreed
    group: object = None  # the group, made where it is first needed


def inside_ddp() -> bool:
    """True while DDP's forward runs (torch.compile(DDP(model)) calls backends from there)."""
    return tc.get_active_ddp_module() is not None


class DataParallel:
    def __init__(self, config: Config, ledger: Ledger, decide_codecs: DecideCodecs | None = None,
                 state: CodecState | None = None, link: Link | None = None):
        """``decide_codecs``: how ``gradient_codec="auto"`` picks each bucket's codec (see
        :data:`DecideCodecs`); required with ``auto``. ``state``: where the buckets' codec
        state is registered (the backend's ``ccfx.codec_state``; default: a holder of its
        own). ``link``: what ``gradient_collective="auto"`` is priced on, the backend's
        decision for this group (with ``cluster``, its slowest link); default the
        ``link_gbps`` link."""
        self.link = link if link is not None else configured_link(config)
        if config.gradient_codec == AUTO and decide_codecs is None:
            raise ConfigError("gradient_codec='auto' needs the planner's decision: build "
                              "DataParallel through the ccfx backend, which passes it")
        self.config = config
        self.ledger = ledger
        self.decide_codecs = decide_codecs
        #: Codec state of every bucket, as buffers named ``graph<g>.bucket<b>.<state-name>``
        #: (:mod:`ccfx.codecs.state`): checkpoint ``state.state_dict()``.
        self.state = state if state is not None else CodecState()
        self._graphs: dict[int, _GraphState] = {}
        dist = _dist()
        if dist is None:
            require_group_under_launcher("data_parallel=True")
            self.world, self.rank, self.backend_name, self.group = 1, 0, "none", None
            self.comm = LocalComm()
            self.note = ("no process group: world size 1, each bucket's codec runs as a local "
                         "round trip (call dist.init_process_group() first to synchronize ranks)")
        else:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            self.backend_name = str(dist.get_backend())
            # each graph's own (its group's name); one rank: local round trips
            self.comm = LocalComm() if self.world == 1 else None
            self.note = ""
        # what the codec state was made for (a checkpoint for another rank is refused)
        self.state.set_meta("world_size", self.world)
        self.state.set_meta("rank", self.rank)
        #: Tensors broadcast from rank 0 already, by id (a recompile does not broadcast them
        #: again).
        self._synced: dict[int, weakref.ref] = {}

    def info(self) -> DataParallelInfo:
        return DataParallelInfo(self.world, self.backend_name, self.config.gradient_codec,
                                self.config.warmup_steps, self.note)

    # -- forward side ---------------------------------------------------------------------

    def add_graph(self, index: int, param_names: Mapping[int, str], sync_inputs: Sequence[int],
                  desc: Mapping | None = None):
        """``desc``: the graph's description (its code hash, inputs, options, grad mode: what
        the backend fingerprints), part of what the ranks agree on."""
        self._graphs[index] = _GraphState(dict(param_names), list(sync_inputs),
                                          desc=dict(desc or {"graph": index}))

    def before_call(self, index: int, args: Sequence) -> None:
        """At a graph's first call: parameters and buffers take rank 0's values."""
        g = self._graphs.get(index)
        if g is None:
            return
        if g.synced:
            self._broadcast_buffers(index, g, args)
            return
        g.synced = True
        self._note_recompile(index, g, args)
        dist = _dist()
        if dist is None or self.world == 1 or not torch.is_grad_enabled():
            return  # under no_grad (an evaluation): no gradients to synchronize
        todo = [args[k] for k in g.sync_inputs
                if isinstance(args[k], torch.Tensor) and not self._was_synced(args[k])]
        if not todo:
            return  # a recompile of a model whose tensors were broadcast already
        group = self._ensure_group(index)
        # the n-th broadcast on this group, of these shapes: ranks that pair two different
        # broadcasts (a copy of the model with grad on one rank only) fail here, not in gloo
        n = _BROADCASTS.get(g.group_name, 0)
        agree.meet("a first-call broadcast", {
            "group": g.group_name, "n": n,
            "shapes": [[list(t.shape), str(t.dtype)] for t in todo]},
            timeout_s=self.config.collective_timeout_s, hint=_HINT, about=(_WHAT, g.agreed))
        _BROADCASTS[g.group_name] = n + 1  # counted once the ranks met (a refused one is not)
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in todo:
                self._wait(lambda t=t: dist.broadcast(t.detach(), src=src, group=group),
                           f"the broadcast of parameters from rank 0 (graph {index})")
                self._synced[id(t)] = weakref.ref(t)

    def _broadcast_buffers(self, index: int, g: _GraphState, args: Sequence) -> None:
        """``broadcast_buffers`` (DDP's default): every forward with grad enabled after the
        first starts from rank 0's buffers."""
        if not self.config.broadcast_buffers or self.world < 2 or not torch.is_grad_enabled():
            return
        buffers = [args[k] for k in g.sync_inputs if k not in g.param_names
                   and isinstance(args[k], torch.Tensor)]
        if not buffers:
            return
        dist = _dist()
        group = self._ensure_group(index)
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in buffers:
                self._wait(lambda t=t: dist.broadcast(t.detach(), src=src, group=group),
                           f"the broadcast of buffers from rank 0 (graph {index}; "
                           "broadcast_buffers=True)")

    def _note_recompile(self, index: int, g: _GraphState, args: Sequence) -> None:
        """A graph of the same code as an earlier one (a recompile: another input shape) says
        so in this rank's record, for the errors of peers that did not recompile."""
        held = set(g.param_names) | set(g.sync_inputs)  # parameters and buffers apart
        g.shapes = [tuple(a.shape) for k, a in enumerate(args)
                    if isinstance(a, torch.Tensor) and k not in held]
        if self.world < 2:
            return
        names = sorted(g.param_names.values())
        dynamo = _dynamo_reason()  # read every time: what it recorded since the last graph
        for k, other in sorted(self._graphs.items(), reverse=True):
            # the same model (its parameters) compiled before: Dynamo recompiled it
            if k == index or other.shapes is None or \
                    sorted(other.param_names.values()) != names:
                continue
            changed = [f"input {i}'s shape changed {_shape(a)} -> {_shape(b)}"
                       for i, (a, b) in enumerate(zip(other.shapes, g.shapes)) if a != b]
            why = ", ".join(changed[:3]) or dynamo  # a branch one rank took, say
            if why:
                agree.note_compile(f"rank {self.rank} recompiled graph {k} (as graph {index}) "
                                   f"because {why}")
            return

    def _was_synced(self, t: torch.Tensor) -> bool:
        ref = self._synced.get(id(t))
        return ref is not None and ref() is t

    # -- backward side --------------------------------------------------------------------

    def compile_backward(self, index: int, gm: torch.fx.GraphModule,
                         compile_fn: Callable[[torch.fx.GraphModule], Callable],
                         decompositions=None,
                         record: Callable[[torch.fx.GraphModule], None] | None = None):
        """Rewrite and compile the backward of graph ``index``; returns a boxed callable."""
        g = self._graphs[index]
        cfg = self.config
        slots = find_param_grads(gm, g.param_names)
        auto = cfg.gradient_codec == AUTO
        # auto: the buckets a lossy codec gets (small and 1-D parameters apart), then a codec
        # per bucket from the cost model
        buckets = assign_buckets(slots, "int8" if auto else cfg.gradient_codec, cfg.bucket_mb,
                                 cfg.compress_min_numel, cfg.min_compression_rate)
        # The backward compiles with the forward, inside its fake mode: the check and the
        # state tensors must be real.
        with tc.unset_fake_temporarily():
            buckets, exchanges, comm, states = self._bucket_exchanges(index, gm, buckets, auto)
        compressed = grad_buckets(copy_graph(gm), buckets, states, comm, decompositions)
        if record is not None:
            record(compressed)
        variants = [(compile_fn(compressed), [t for s in states for _, t in sorted(s.items())])]
        warm = None
        if cfg.warmup_steps and any(b.spec != "none" for b in buckets):
            plain = [type(b)(b.index, b.slots, "none", "warm-up") for b in buckets]
            warm = compile_fn(grad_buckets(copy_graph(gm), plain, [{} for _ in plain], comm,
                                           decompositions))
        g.buckets = [self._plan_bucket(index, b, ex) for b, ex in zip(buckets, exchanges)]
        described = "; ".join(f"bucket {b.index}: {len(b.slots)} params, {b.spec} via "
                              f"{ex.collective}" for b, ex in zip(buckets, exchanges))

        # the backward count (what ends warmup_steps) is codec state: a resumed run goes on
        # where the saved one was
        with tc.unset_fake_temporarily():
            steps = self.state.get_meta(f"graph{index}.backward_steps")  # loaded, or recompiled
            if steps is None:
                steps = self.state.set_meta(f"graph{index}.backward_steps", g.backward_calls)
        return self._backward_call(index, steps, warm, variants[0], described)

    def _bucket_exchanges(self, index: int, gm: torch.fx.GraphModule, buckets, auto: bool):
        """The buckets with their codecs (``auto``: chosen on rank 0) and collectives, their
        exchanges, the group's comm and each bucket's codec state (real tensors)."""
        if auto:
            buckets = self._choose(index, gm, buckets)
        buckets = self._collectives(buckets)
        exchanges = [exchange_for(b.layout, b.spec, b.collective) for b in buckets]
        comm = self._name_group(index, buckets)
        states = []
        for b, ex in zip(buckets, exchanges):
            states.append(self.state.add(bucket_channel(index, b.index), b.spec,
                                         ex.init_state(device_of(gm)),
                                         legacy=f"buckets.graph{index}_bucket{b.index}_"))
        return buckets, exchanges, comm, states

    def _backward_call(self, index: int, steps: torch.Tensor, warm: Callable | None,
                       compressed: tuple[Callable, list], described: str) -> Callable:
        """The boxed backward of graph ``index``: the uncompressed ``warm`` one for the
        warm-up steps, else the compressed one with its codec state; each counts its
        backward, records its buckets' bytes, and names the buckets when a collective fails."""
        g, cfg = self._graphs[index], self.config
        plain_rows = [(b.index, b.raw_bytes, b.raw_bytes) for b in g.buckets]
        rows = [(b.index, b.raw_bytes, b.wire_bytes) for b in g.buckets]

        def run(args):
            if g.group is None and self.world > 1:
                self._ensure_group(index)  # its first backward: the ranks agree, then make it
            step = int(steps)
            steps.add_(1)
            g.backward_calls = step + 1
            fn, extra, counted = (warm, [], plain_rows) if (
                warm is not None and step < cfg.warmup_steps) else (*compressed, rows)
            if self.world > 1:
                agree.entering(f"the gradient collectives of graph {index}", g.group_name,
                               g.collectives, self._ranks())
                g.collectives += 1
            try:
                out = fn(list(args) + extra)
            except RuntimeError as e:
                raise self._backward_failed(index, e, described) from e
            finally:
                if isinstance(args, list):
                    args.clear()  # the boxed convention: the callee frees its inputs
            for b, raw, wire in counted:
                self.ledger.record_bucket(index, b, raw, wire)
            return out

        return tc.mark_boxed(run)

    def _backward_failed(self, index: int, e: RuntimeError, described: str) -> CollectiveError:
        """The error of a backward whose gradient collectives failed: the buckets in flight,
        who is to blame and what the peers said."""
        agree.gave_up(f"the gradient collectives of graph {index}", _first_line(e))
        who = agree.blame(e)
        who = f" {who[0].upper()}{who[1:]}." if who else ""
        # what peers recompiled, and (no dead peer) why they gave up
        notes = agree.peer_notes(failures="rank " not in who.lower())
        who = f"{who} {notes}" if notes else who
        return CollectiveError(
            f"rank {self.rank} of {self.world}: the backward of graph {index} failed while "
            f"its gradient collectives were in flight ({described}; group timeout "
            f"{self.config.collective_timeout_s:g} s): {_first_line(e)}.{who} A peer rank died, "
            "hung, or is running a different model; see that rank's own error.")

    def _choose(self, index: int, gm: torch.fx.GraphModule, buckets):
        """``gradient_codec="auto"``: rank 0 prices every bucket (``decide_codecs``, the
        planner's) and every rank takes its choice (the payloads must agree)."""
        g = self._graphs[index]
        choice, g.decisions, g.prediction = agree.from_rank0(
            "gradient_codec='auto' for a graph's buckets",
            {"graph": g.desc, "buckets": self._describe(buckets)},
            lambda: self.decide_codecs(gm, buckets, self.config, self.world),
            timeout_s=self.config.collective_timeout_s, ranks=self._ranks(), hint=_HINT)
        return [type(b)(b.index, b.slots, choice.get(b.index, b.spec), b.reason)
                if b.spec != "none" else b for b in buckets]

    def _collectives(self, buckets):
        """Each bucket's collective from ``gradient_collective`` ("auto": the cheaper for
        this world on the link the backend gave, a deterministic function of both, so every
        rank picks the same; the fingerprint check confirms it). Only non-summable codecs
        have a choice."""
        link = self.link
        out = []
        for b in buckets:
            if codecs.prototype(b.spec).reduction == "sum":
                out.append(b)
                continue
            c = resolve_collective(self.config.gradient_collective, b.spec, b.layout.numel,
                                   b.layout.dtype, self.world, link)
            out.append(dataclasses.replace(b, collective=c))
        return out

    def decisions(self, index: int) -> list:
        g = self._graphs.get(index)
        return list(g.decisions) if g else []

    def prediction(self, index: int):
        g = self._graphs.get(index)
        return g.prediction if g else None

    def buckets(self, index: int) -> list[Bucket]:
        g = self._graphs.get(index)
        return list(g.buckets) if g else []

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def _plan_bucket(index: int, b, ex) -> Bucket:
        return Bucket(graph=index, index=b.index, params=[s.name for s in b.slots],
                      numel=b.layout.numel, dtype=str(b.layout.dtype), codec=b.spec,
                      collective=ex.collective, raw_bytes=ex.raw_bytes,
                      wire_bytes=ex.wire_bytes(), reason=b.reason)

    @staticmethod
    def _describe(buckets) -> list:
        return [[b.spec, b.collective, [[s.name, list(s.shape), str(s.dtype)] for s in b.slots]]
                for b in buckets]

    def _ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world))

    def _name_group(self, index: int, buckets):
        """What the ranks agree on for graph ``index`` (its description, the options that shape
        the gradient collectives, the buckets), the name of its group, and the comm the
        backward issues its collectives through (naming that group)."""
        g = self._graphs[index]
        keys = ("gradient_codec", "gradient_collective", "bucket_mb", "compress_min_numel",
                "min_compression_rate", "warmup_steps")
        g.agreed = {"graph": g.desc, "options": {k: getattr(self.config, k) for k in keys},
                    "buckets": self._describe(buckets)}
        if _dist() is None or self.world == 1:
            return self.comm
        g.group_name = agree.group_name(_WHAT, g.agreed, self._ranks())
        agree.reserve(g.group_name, self._ranks())  # inductor reads it while compiling
        return FunctionalComm(g.group_name, self.world)

    def _ensure_group(self, index: int):
        """Graph ``index``'s process group, made the first time a rank needs it (its first
        broadcast or backward): the ranks agree on its fingerprint first."""
        g = self._graphs[index]
        if g.group is None:
            if not g.agreed:  # no backward compiled (no parameter requires grad)
                g.agreed = {"graph": g.desc}
                g.group_name = agree.group_name(_WHAT, g.agreed, self._ranks())
            g.group = agree.group(_WHAT, g.agreed, self._ranks(),
                                  timeout_s=self.config.collective_timeout_s, hint=_HINT)
            assert g.group.group_name == g.group_name
        return g.group

    def _wait(self, fn, what: str):
        try:
            return fn()
        except RuntimeError as e:
            timeout = f"group timeout {self.config.collective_timeout_s:g} s"
            agree.gave_up(what, _first_line(e))
            who = agree.blame(e)
            who = f" {who[0].upper()}{who[1:]}." if who else ""
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: {what} failed ({timeout}): "
                f"{_first_line(e)}.{who} A peer rank died, hung or diverged.") from e


_WHAT = "the data-parallel plan of a graph"
_HINT = ("The ranks planned different gradient buckets or options for this graph: every rank "
         "must run the same model with the same ccfx options (a parameter used on some ranks "
         "only, or different options, makes the collectives differ). A model compiled on some "
         "ranks only (an eval copy) must run under torch.no_grad() there, or without "
         "data_parallel.")
#: First-call broadcasts made on each group (by name): the n-th pairs with the peers' n-th.
_BROADCASTS: dict[str, int] = {}


#: Dynamo's guard failures per code object when last read: (count, the last one).
_GUARD_FAILURES_SEEN: dict = {}


def _dynamo_reason() -> str:
    """Why Dynamo recompiled most recently, from its record of failed guards
    (``torch._dynamo.utils.guard_failures``: per frame, one line per recompile), as
    ``"Dynamo's guard failed: self.flag == False"``; ``""`` when it recorded nothing new."""
    try:
        guard_failures = tc.guard_failures
    except (ImportError, AttributeError):  # another torch
        return ""
    latest = ""
    for code, failures in list(guard_failures.items()):
        # (count, last entry) when last read: torch._dynamo.reset() empties the lists, so a
        # count alone could miss a new failure
        now = (len(failures), failures[-1] if failures else None)
        seen = _GUARD_FAILURES_SEEN.get(code)
        if failures and (seen is None or seen[0] != now[0] or seen[1] is not now[1]):
            latest = str(failures[-1])
        _GUARD_FAILURES_SEEN[code] = now
    text = latest.splitlines()[0].split("#")[0].strip() if latest.strip() else ""
    if ": " in text and text.split(": ", 1)[0].replace("/", "").isdigit():
        text = text.split(": ", 1)[1]  # Dynamo's "0/1: " (frame/compile) prefix
    return f"Dynamo's guard failed: {text}" if text else ""


def _shape(s) -> str:
    return "(" + ", ".join(str(d) for d in s) + ")" if s is not None else "(not a tensor)"


