"""ccfx's gradient codecs as a DDP communication hook, for eager ``DistributedDataParallel``.

    state, hook = ccfx.ddp_comm_hook("powersgd:rank=4,ef")  # "int8", "fp16", "topk:ratio=0.01,ef"
    ddp_model.register_comm_hook(state, hook)
    torch.save(state.state_dict(), path)                     # beside the model's and optimizer's

The hook runs the same :mod:`~ccfx.wire.exchange` phases as the compiled data-parallel
path, with :class:`~ccfx.wire.comm.ProcessGroupComm` issuing ``torch.distributed`` collectives
on the hook's process group. A DDP bucket holds every parameter in it, 1-D biases included; the codec is applied
to the whole bucket (PowerSGD sends the tensors where low rank does not pay raw).

Phases run one after the other inside the hook, and the hook returns an already completed
future; the collectives *within* a phase are all issued before the first is waited on (PowerSGD's
P and raw all-reduces travel together). The phases are not chained with ``Future.then`` as in
``powerSGD_hook``: on gloo a ``then`` callback runs on the process group's worker thread and would
issue the next phase's collective from there, so two buckets' collectives could be issued in
different orders on different ranks, and gloo aborts with "Received data size doesn't match
expected size" (torch 2.13's own ``powerSGD_hook`` did so on gloo with two ranks and two buckets,
in each of three runs). Issued from the autograd thread, in bucket order, the collectives come in
the same order on every rank. On NCCL ``Work.wait()`` only makes the current CUDA stream wait, so
the CPU goes on; on gloo the backward pauses while a bucket is exchanged.

Buckets and state. Each bucket's codec state (PowerSGD's Q, error-feedback residuals, step
counters) is keyed by ``bucket.index()`` and made at the bucket's first call (by the exchange's
``init_state``, passed to every call). A checkpoint (``state_dict()``) names it as every ccfx
checkpoint does (:mod:`ccfx.codecs.state`): ``state["state"]["ddp.bucket0.q0000"]``, beside
``state["buckets"][0]``, the gradient shapes and dtype the bucket's state was made for, and
``state["world_size"]`` / ``state["rank"]``: the state is this rank's own, so a checkpoint loaded
on another rank or world size is a :class:`~ccfx.ConfigError` (one saved before ccfx recorded
them loads unchecked). DDP regroups its
buckets once, after its first iteration (unless ``find_unused_parameters=True``), so a bucket
index can come back with other gradients in it: that bucket then starts from fresh state, since
a Q or a residual belongs to the gradients it was made for. For the same reason a resumed run
reproduces the uninterrupted one bit for bit only when its buckets are those of the checkpoint
from the first iteration on: with ``find_unused_parameters=True`` they are; otherwise the loaded
state waits for the rebuilt buckets and the resumed run's first iteration uses fresh state (a
:class:`~ccfx.CcfxWarning` says so).

Uneven inputs (DDP's ``join``). torch's own ``Join([ddp_model])`` works with this hook (tested
in tests/test_state_meta.py): a rank out of data shadows its peers' remaining steps, DDP running
the hook on zero gradients, so every rank issues the same collectives and ends with the same
parameters (DDP gives the joined ranks the last one's). The joined rank's codec state goes on
too: with error feedback it sends what its residual still holds (late, as error feedback always
sends). Compiled data parallel (``data_parallel=True``) has no such context, by decision: its
collectives are spliced into the compiled backward, so a rank out of data could shadow them only
by running the compiled forward and backward on a batch of its peers' shapes, and every step
would first need a collective asking which ranks still have data (DDP's Join pays one all-reduce
per step for it). There, give every rank the same number of equal batches
(``DataLoader(drop_last=True)``, ``DistributedSampler(..., drop_last=True)``), or stop every rank
after the smallest rank's number of batches (``all_reduce(MIN)`` of ``len(loader)`` before
training); a rank that recompiles for an uneven batch is named (README, "When things fail").

Failures. A bucket exchange that fails (a peer died, froze, or ran another model) is a
:class:`~ccfx.CollectiveError` naming this rank, the bucket, codec, collective and step, and the
peer (the hook publishes this process's host and pid at its first bucket, for
:func:`ccfx.wire.agree.blame`); DDP hands it to ``backward()``'s caller as it is. On CPU (gloo)
each wait lasts at most ``collective_timeout_s`` (``Work.wait(timeout)``), so a frozen peer is
named within it; DDP's group, which the user (or the framework) made, keeps its own timeout.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_compat as tc
from .. import codecs
from ..codecs.state import SCHEME, check, check_finite, check_place, ddp_channel, named, split_key
from ..config import COLLECTIVES, Config
from ..errors import CcfxWarning, CollectiveError, ConfigError
from ..wire.comm import ProcessGroupComm
from ..wire.exchange import BucketLayout, Exchange, exchange_for
from ..wire.link import resolve_collective
from .ledger import Ledger
from .timings import note_exchange, now

Hook = Callable[["CommHookState", dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class _BucketState:
    """One DDP bucket's exchange and the codec state tensors it updates in place."""

    layout: BucketLayout
    exchange: Exchange
    tensors: dict[str, torch.Tensor]


def _layout_of(bucket: dist.GradBucket) -> BucketLayout:
    grads = bucket.gradients()
    return BucketLayout(tuple(tuple(g.shape) for g in grads), grads[0].dtype)


class CommHookState:
    """What :func:`ddp_comm_hook`'s hook keeps between calls: the codec spec, the process group,
    each bucket's codec state and the number of DDP steps reduced (``steps``).

    ``state_dict()`` / ``load_state_dict()`` checkpoint it, so that a resumed run continues with
    the same Q's and residuals (see the module docstring on DDP's bucket rebuild).
    """

    def __init__(self, spec: str, process_group=None, collective: str = "all_gather", *,
                 collective_timeout_s: float = Config.collective_timeout_s):
        if collective not in COLLECTIVES:
            raise ConfigError(f"collective={collective!r}: choose one of {', '.join(COLLECTIVES)}")
        if isinstance(collective_timeout_s, bool) or not isinstance(
                collective_timeout_s, (int, float)) or not collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s={collective_timeout_s!r}: give seconds, a "
                              "positive number (e.g. 300)")
        #: how long a wait on CPU (gloo) lasts before the peers are named
        self.collective_timeout_s = float(collective_timeout_s)
        if isinstance(spec, str) and spec.strip().lower().startswith("adaptive"):
            raise ConfigError(
                f"{spec!r} switches each bucket between two codecs, which needs its own hook: "
                f"ddp_model.register_comm_hook(*ccfx.ddp_comm_hook({spec!r})); register_codec "
                "and this state take one fixed codec")
        self.spec = codecs.canonical(spec)
        self.process_group = process_group
        self.collective = collective
        self.steps = 0
        self.buckets: dict[int, _BucketState] = {}
        #: loaded entries whose bucket has not been seen yet with the layout they were saved for
        self._pending: dict[int, dict[str, Any]] = {}
        self._warned_mismatch = False
        #: bytes per bucket per step, counted as the hook runs (``ccfx.ledger_of(ddp_model)``)
        self.ledger = Ledger()
        #: bucket index -> (the step of its latest call, the ids of its parameters), for
        #: plan_of_hook (DDP regroups its buckets after the first step)
        self._bucket_params: dict[int, tuple[int, tuple[int, ...]]] = {}

    # -- per-bucket state ---------------------------------------------------------------------

    def bucket_state(self, bucket: dist.GradBucket) -> _BucketState:
        """The state of ``bucket``, made (or taken from a loaded checkpoint) when the bucket is
        new or DDP regrouped it."""
        index, layout = bucket.index(), _layout_of(bucket)
        live = self.buckets.get(index)
        if live is None or live.layout != layout:
            live = self._new_bucket_state(index, layout, bucket.buffer().device)
            self.buckets[index] = live
        return live

    def _new_bucket_state(self, index: int, layout: BucketLayout, device) -> _BucketState:
        from ..wire import agree

        agree.publish_process()  # once per process: a peer's error can then name this rank
        exchange = self._exchange_for(index, layout)
        tensors = exchange.init_state(device)
        saved = self._pending.get(index)
        if saved is not None and _saved_layout(saved) == layout:
            del self._pending[index]
            channel = ddp_channel(index)
            check(named(channel, tensors), named(channel, saved["state"]), {channel: self.spec},
                  "DDP comm hook state")
            for name, t in tensors.items():
                t.copy_(saved["state"][name])
        elif saved is not None:
            self._warn_mismatch(index)
        return _BucketState(layout, exchange, tensors)

    def _exchange_for(self, index: int, layout: BucketLayout) -> Exchange:
        """Bucket ``index``'s exchange (a mode switching codecs per bucket gives its own)."""
        # "auto" by bytes (no link given): the same answer on every rank
        collective = resolve_collective(self.collective, self.spec, layout.numel, layout.dtype,
                                        dist.get_world_size(self.process_group))
        return exchange_for(layout, self.spec, collective)

    def _same_codec(self, saved: str) -> bool:
        """Whether a checkpoint's spec is this hook's (one no codec reads is not)."""
        try:
            return codecs.canonical(saved) == self.spec
        except ConfigError:  # e.g. an adaptive hook's: the caller names both specs
            return False

    def plan_spec(self) -> str:
        """The codec a plan's config names (the buckets' rows name each one's own)."""
        return self.spec

    def _warn_mismatch(self, index: int) -> None:
        if self._warned_mismatch:
            return
        self._warned_mismatch = True
        warnings.warn(
            f"ccfx.ddp_comm_hook: DDP bucket {index} holds other gradients than the checkpoint's "
            "bucket of that index (DDP groups them anew in its first iteration and rebuilds its "
            "buckets after it). This bucket starts from fresh codec state; the loaded state is "
            "used once a bucket matches it. For a resume that reproduces an uninterrupted run "
            "exactly, construct DDP with find_unused_parameters=True: its buckets never change.",
            CcfxWarning, stacklevel=3)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"spec", "steps", "buckets": {index: {"shapes", "dtype"}}, "state": {name:
        tensor}}``: copies of every bucket's state, named ``ddp.bucket<index>.<state-name>``
        (:mod:`ccfx.codecs.state`), with the layout it belongs to; loaded entries not used yet
        are included, so saving right after loading keeps them."""
        live = {i: {"shapes": b.layout.shapes, "dtype": b.layout.dtype,
                    "state": {k: t.detach().clone() for k, t in b.tensors.items()}}
                for i, b in self.buckets.items()}
        entries = {**{i: _clone_entry(e) for i, e in self._pending.items() if i not in live},
                   **live}
        return {"spec": self.spec, "steps": self.steps, **self._place(),
                "buckets": {i: {"shapes": e["shapes"], "dtype": e["dtype"]}
                            for i, e in entries.items()},
                "state": {k: t for i, e in entries.items()
                          for k, t in named(ddp_channel(i), e["state"]).items()}}

    def _place(self) -> dict[str, int]:
        """What this state is made for: the hook's world size and this rank in it (error
        feedback's residuals are each rank's own)."""
        if not (dist.is_available() and dist.is_initialized()):
            return {"world_size": 1, "rank": 0}
        return {"world_size": dist.get_world_size(self.process_group),
                "rank": dist.get_rank(self.process_group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy saved state into the live buckets it fits; keep the rest for the first call of a
        bucket with the saved layout. Checkpoints of the earlier layout (each bucket's state
        nested in its entry) load too. A checkpoint made for another codec, world size or rank
        is a :class:`~ccfx.ConfigError` saying what differs; one saved before ccfx recorded
        the world size and rank loads without that check. Damaged state (NaN or ±inf,
        unreadable entries) is a :class:`~ccfx.ConfigError` naming the bucket's channel."""
        _check_readable(state)
        if not self._same_codec(state["spec"]):
            raise ConfigError(f"this hook state is for codec {self.spec!r}, the checkpoint's is "
                              f"for {state['spec']!r}: build the hook with the checkpoint's spec")
        check_place({k: state[k] for k in ("world_size", "rank") if k in state}, self._place(),
                    "DDP comm hook state")
        entries = _entries(state)
        check_finite({k: t for i, e in entries.items()
                      for k, t in named(ddp_channel(i), e["state"]).items()},
                     "DDP comm hook state", fix=_FIX)
        self.steps = int(state["steps"])
        self._pending = {}
        for index, entry in entries.items():
            live = self.buckets.get(index)
            if live is not None and live.layout == _saved_layout(entry):
                channel = ddp_channel(index)
                check(named(channel, live.tensors), named(channel, entry["state"]),
                      {channel: self.spec}, "DDP comm hook state")
                for name, t in live.tensors.items():
                    t.copy_(entry["state"][name])
            else:
                self._pending[index] = _clone_entry(entry)


_FIX = ("Resume from an earlier checkpoint, or leave the hook's state out (do not load it; "
        "through a framework, delete this rank's ccfx_comm_hook_rank<rank>.pt, or the "
        "LightningCodecCallback entry of the .ckpt's 'callbacks'): the codec starts afresh, "
        "error feedback from zero, PowerSGD from a new Q.")


def _check_readable(state: Any) -> None:
    """:class:`~ccfx.ConfigError` unless ``state`` has the entries of :meth:`CommHookState.
    state_dict` in their types (a damaged or foreign checkpoint fails here, not as a KeyError
    deep inside the load)."""
    kinds = {"spec": str, "steps": (int, torch.Tensor), "buckets": dict}
    if isinstance(state, dict):
        bad = [f"{k!r} is {type(state[k]).__name__ if k in state else 'missing'}"
               for k, kind in kinds.items() if not isinstance(state.get(k), kind)]
        if "state" in state and not isinstance(state["state"], dict):
            bad.append(f"'state' is {type(state['state']).__name__}")
    else:
        bad = [f"it is a {type(state).__name__}, not a dict"]
    if bad:
        raise ConfigError(f"the checkpoint's DDP comm hook state cannot be read ({'; '.join(bad)}"
                          "): it is damaged, or not CommHookState.state_dict()'s. " + _FIX)


def _entries(state: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each saved bucket as ``{"shapes", "dtype", "state": {state-name: tensor}}``."""
    if "state" not in state:  # the earlier layout: the state inside each bucket's entry
        return dict(state["buckets"])
    entries = {i: {**e, "state": {}} for i, e in state["buckets"].items()}
    by_channel = {ddp_channel(i): i for i in entries}
    for k, t in state["state"].items():
        channel, name = split_key(k)
        if channel not in by_channel:
            raise ConfigError(f"DDP comm hook state {k!r}: no bucket {channel!r} in the "
                              f"checkpoint's 'buckets' (names are {SCHEME})")
        entries[by_channel[channel]]["state"][name] = t
    return entries


def _saved_layout(entry: dict[str, Any]) -> BucketLayout:
    return BucketLayout(tuple(tuple(s) for s in entry["shapes"]), entry["dtype"])


def _clone_entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "state": {k: t.detach().clone() for k, t in entry["state"].items()}}


def codec_hook(state: CommHookState,
               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` through the codec; DDP copies the result into the gradients (and logs
    this function's name as the comm hook). No ``from __future__ import annotations`` in this
    module: DDP checks these two annotations against the classes themselves."""
    live = state.bucket_state(bucket)
    on_cpu = bucket.buffer().device.type == "cpu"  # a CUDA wait orders streams instead
    comm = ProcessGroupComm(state.process_group, state.collective_timeout_s if on_cpu else None)
    entered = now()  # ccfx.diagnose: when this rank was ready to exchange the bucket
    try:
        averaged = live.exchange.run(bucket.gradients(), live.tensors, comm)
    except RuntimeError as e:
        raise _failed(state, bucket, live, e) from e
    note_exchange(state, state.steps, entered, bucket.is_last())  # ccfx.diagnose's timings
    buffer = bucket.buffer()
    flat = torch.cat([t.reshape(-1) for t in averaged]).to(buffer.dtype).view(buffer.shape)
    state.ledger.record_bucket(0, bucket.index(), live.exchange.raw_bytes,
                              live.exchange.sent_bytes())
    state._bucket_params[bucket.index()] = (state.steps,
                                            tuple(id(p) for p in bucket.parameters()))
    if bucket.is_last():
        state.steps += 1
        state.ledger.count_call(0)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(flat)
    return fut


def _failed(state: CommHookState, bucket: dist.GradBucket, live: _BucketState,
            e: RuntimeError, step: int | None = None) -> CollectiveError:
    """A failed exchange (a dead, frozen or diverged peer: gloo's error, after
    ``collective_timeout_s`` at most on CPU) as a :class:`~ccfx.CollectiveError` naming this
    rank, the bucket, what was awaited and the peer rank gloo's address points at (:func:`ccfx.wire.agree.blame`).
    DDP passes it on as the ``RuntimeError`` of ``backward()``, with this text."""
    from ..wire import agree

    what = (f"the DDP comm hook's exchange of bucket {bucket.index()} ({state.spec} via "
            f"{live.exchange.collective}, step {state.steps if step is None else step})")
    first, who = agree.failed(what, e, agree.world_ranks(state.process_group))
    rank, world = dist.get_rank(), dist.get_world_size(state.process_group)
    return CollectiveError(
        f"rank {rank} of {world}: {what} failed: {first.rstrip('.!')}.{who} A peer rank died, "
        f"froze or fell behind past collective_timeout_s ({state.collective_timeout_s:g} s on "
        "CPU), or ran a different model; see that rank's own error.")


def ddp_comm_hook(spec: str, process_group=None, collective: str = "all_gather", *,
                  collective_timeout_s: float = Config.collective_timeout_s,
                  ) -> tuple[CommHookState, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``: DDP's buckets are
    averaged through the codec ``spec`` (``"none"``, ``"fp16"``, ``"int8"``,
    ``"topk:ratio=0.01,ef"``, ``"powersgd:rank=4,ef"``, ...) over ``process_group`` (default:
    WORLD). The spec is checked here (:class:`~ccfx.ConfigError` lists the codecs), not at the
    first backward. Every rank ends with the same averaged gradients, bit for bit.
    ``collective``: how non-summable payloads are averaged, ``"all_gather"``, ``"ring"``
    (:mod:`ccfx.wire.ring`) or ``"auto"`` (the ring from 3 ranks, by bytes).
    ``collective_timeout_s``: how long a CPU rank waits for its peers before naming them."""
    return (CommHookState(spec, process_group, collective,
                          collective_timeout_s=collective_timeout_s), codec_hook)


def hook_state_of(model) -> CommHookState | None:
    """The :class:`CommHookState` of the ccfx hook registered on a DDP model, or None (not a
    DDP model, or no ccfx hook on it). DDP keeps its ``(hook, state)`` pairs in
    ``_comm_hooks``, whoever registered them (``ddp.register_comm_hook(*ccfx.ddp_comm_hook(...))``,
    a framework, :mod:`ccfx.integrations`): so ``ccfx.ledger_of(ddp_model)`` needs nothing
    attached to the model. A state itself is returned as it is."""
    if isinstance(model, CommHookState):
        return model
    for hook, state in tc.ddp_comm_hooks(model):
        if isinstance(state, CommHookState):  # codec_hook, or ccfx.delayed_comm_hook's
            return state
    return None


def plan_of_hook(state: CommHookState, model=None):
    """A :class:`~ccfx.Plan` of the hook's buckets as DDP made them (as of the latest step:
    DDP rebuilds its buckets after the first one): one row per bucket with its parameters
    (named from ``model``, the DDP model or its module, when given), the codec, the collective
    and raw / wire bytes per step. Empty before the first backward."""
    from ..config import Config
    from ..plan import Bucket, DataParallelInfo, GraphPlan, Plan, Stage

    names: dict[int, str] = {}
    if model is not None:
        inner = getattr(model, "module", model)
        names = {id(p): n for n, p in inner.named_parameters()}
    buckets = []
    latest = max((step for step, _ in state._bucket_params.values()), default=0)
    for index in sorted(state.buckets):
        live = state.buckets[index]
        step, ids = state._bucket_params.get(index, (latest, ()))
        if step != latest:  # a bucket of DDP's first grouping, gone since
            continue
        params = [names.get(i, f"param{k}") for k, i in enumerate(ids)]
        buckets.append(Bucket(graph=0, index=index, params=params, numel=live.layout.numel,
                              dtype=str(live.layout.dtype), codec=live.exchange.spec,
                              collective=live.exchange.collective,
                              raw_bytes=live.exchange.raw_bytes,
                              wire_bytes=live.exchange.wire_bytes()))
    note = ("DDP's own buckets (bucket_cap_mb), each averaged by ccfx's comm hook "
            "(ccfx.ddp_comm_hook); no stages: the model runs as DDP runs it")
    if not buckets:
        note += "; no bucket reduced yet (run one backward)"
    whole = Stage(graph=0, index=0, nodes=[], cost=0.0, cost_expr="0", flops=0,
                  param_bytes=sum(b.raw_bytes for b in buckets),
                  params=[p for b in buckets for p in b.params])
    graph = GraphPlan(index=0, requested_stages=1, num_stages=1, balance="ddp", stages=[whole],
                      edges=[], shared=[], notes=[note], buckets=buckets)
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(state.process_group) if initialized else 1
    backend = str(dist.get_backend(state.process_group)) if initialized else "none"
    config = Config(gradient_codec=state.plan_spec(), gradient_collective=state.collective)
    return Plan(config.to_dict(), [graph], option_sources={"gradient_codec": "ddp_comm_hook"},
                data_parallel=DataParallelInfo(world, backend, state.spec,
                                               note="DDP comm hook (ccfx.ddp_comm_hook)"))
