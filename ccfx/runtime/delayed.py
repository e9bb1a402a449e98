"""Delayed data parallel with periodic exact correction (CD-SGD) as a DDP communication hook.

    state, hook = ccfx.delayed_comm_hook("int8", correct_every=10)
    ddp_model.register_comm_hook(state, hook)
    torch.save(state.state_dict(), path)      # waits for the exchange in flight first

Each bucket's compressed exchange of step t is issued in the hook at step t (the codec's payload
goes to the wire layer's asynchronous collectives, :class:`~ccfx.wire.comm.ProcessGroupComm`)
and waited on at step t+1, when the same parameters' bucket is ready again: the transfer runs
under the whole of the next forward and most of its backward. The hook hands DDP the averaged
gradient of step t-1: every gradient is applied exactly one step late, and the first step applies
zeros. Zeros, not the local gradient: a local gradient differs per rank, so replicas would part
for good, while DDP's contract (and this hook's) is that every rank applies the same bits.

Correction (Yu et al., "CD-SGD: Distributed Stochastic Gradient Descent with Compression and
Delay Compensation", ICPP 2021: k-step correction with the full-precision gradient). Every rank
keeps ``owed``, in fp32, what the averages credited to it lack: its raw gradients since the last
correction minus the averages that arrived for them. At every ``correct_every``-th step (steps
k-1, 2k-1, ...) the step's gradient is added to ``owed`` and the whole of it travels exact (an
fp32 all-reduce, no codec), ``owed`` starts again from zero and so does error feedback's residual
(the correction pays what it held). That exchange is delayed like the others: its mean is
applied at the next step. Hence the invariant the tests check: once the step after correction
step c has applied its gradient, the sum of the gradients applied so far equals the sum of the
exact means ``G_s = mean_ranks(g_s)`` for s <= c, up to fp32 rounding (bit for bit when every sum
is exactly representable); with codec ``none`` every step applies ``G_{t-1}`` itself, bit for
bit, the correction carrying only rounding. Between corrections the gap is the one exchange in
flight plus at most k-1 steps of compression error (not unbounded, as without it).

Compensation (``compensate=λ``; Zheng et al., "Asynchronous Stochastic Gradient Descent with
Delay Compensation", ICML 2017, DC-ASGD-a): the average of step t-1 was taken at the weights
of step t-1 and is applied at those of step t; :func:`compensated` moves it there with a
diagonal Hessian estimate, ``G + λ · G ⊙ G ⊙ (w_t − w_{t−1}) / sqrt(v)``, ``v`` the moving
average of ``G ⊙ G``. Under AdamW ``λ · lr`` of a few units is the useful range (bench/delayed:
``λ = 1000`` at ``lr = 3e-3``). It costs two fp32 copies of the parameters (``w_{t−1}``, ``v``).

The wait is in the autograd thread, in bucket order, as every other collective of the hook:
collectives are issued in one order on every rank (see :mod:`ccfx.runtime.comm_hook`), no second
process group and no thread. What is overlapped is the wire; the codec's encode and decode still
run in the hook. Exchanges that wait in the middle cannot be delayed this way and are a
:class:`~ccfx.ConfigError`: PowerSGD (its Q all-reduce needs P's average first), ``tlc`` (it
agrees on a variable payload length first) and the re-encoding ring (point to point, blocking).

State is per parameter (DDP regroups its buckets after the first step; the flights of step 0,
issued in the first grouping, are landed parameter by parameter into the second). Memory: one
averaged gradient waiting per parameter, ``owed`` in fp32 with a correction, and the payload in
flight. ``state_dict()`` first waits for every exchange in flight (a checkpoint is never taken
mid-flight), then saves, beside the codec's state, each bucket's ``stale`` (the averaged gradient
the next step applies) and ``owed``, named ``ddp.bucket<i>.stale`` / ``ddp.bucket<i>.owed``. A
resume is bit exact when its buckets are the checkpoint's from the first step (DDP's
``find_unused_parameters=True``); otherwise the saved ``stale`` and ``owed`` are dropped with a
:class:`~ccfx.CcfxWarning`. The last step's exchange is still in flight when training stops: its
gradient would be applied by a further step. A failed or timed-out wait is the comm hook's
:class:`~ccfx.CollectiveError`, one step later than under the synchronous hook (at the wait).
"""

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import codecs
from ..codecs.powersgd import PowerSGD
from ..codecs.state import check_finite, ddp_channel, key, split_key
from ..config import Config
from ..errors import CcfxWarning, ConfigError
from ..wire.comm import ProcessGroupComm
from ..wire.exchange import BucketLayout, Exchange, exchange_for
from .comm_hook import CommHookState, Hook, _BucketState, _failed, _saved_layout

#: the names this mode adds to a bucket's channel in a checkpoint
STALE, OWED, PREV, MEAN_SQ = "stale", "owed", "prev", "mean_sq"
#: DC-ASGD-a's moving average of the squared gradient (its paper's m = 0.95)
MEAN_SQ_DECAY = 0.95


def compensated(g: torch.Tensor, w: torch.Tensor, prev: torch.Tensor, mean_sq: torch.Tensor,
                lam: float) -> torch.Tensor:
    """DC-ASGD-a's delay compensation (Zheng et al., ICML 2017): the gradient ``g`` taken at
    the weights ``prev``, moved to the weights ``w`` by a first-order Taylor step whose Hessian
    is approximated by ``g ⊙ g`` scaled by ``lam / sqrt(mean_sq)``, in fp32:
    ``g + lam · g ⊙ g ⊙ (w − prev) / sqrt(mean_sq)``. Every term is the same on every rank, so
    the replicas still apply the same bits."""
    g32 = g.float()
    scale = (w.detach().float() - prev).mul_(g32).mul_(g32).div_(mean_sq.sqrt().add_(1e-12))
    return torch.add(g32, scale, alpha=lam).to(g.dtype)


@dataclass
class _Flight:
    """One bucket's exchange issued at ``step`` and not yet waited on."""

    step: int
    params: tuple[int, ...]  # ids of the bucket's parameters, in bucket order
    exchange: Exchange
    state: list[torch.Tensor]  # the exchange's state tensors, in its phases' order
    carry: list  # the first phase's collective handles
    exact: bool  # a correction: owed, in fp32, with no codec
    device: str  # the gradients' device type (a CPU wait is bounded)


def _check_delayable(spec: str) -> None:
    codec = codecs.prototype(spec)
    inner = getattr(codec, "inner", codec)
    why = ("PowerSGD's second all-reduce (Q) needs the first's average (P)" if isinstance(
        inner, PowerSGD) else "it agrees on a variable payload length first, waiting"
        if codec.variable else None)
    if why:
        raise ConfigError(
            f"delayed_comm_hook({spec!r}): this codec cannot be delayed: {why}, so its exchange "
            "would block in the hook. Use a one-round codec (int8, fp16, topk:ratio=0.01,ef, "
            f"sign, qsgd, ...), or ccfx.ddp_comm_hook({spec!r}) for the synchronous hook")


def _check_compensate(lam) -> None:
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float))
                            or not math.isfinite(lam) or lam <= 0):
        raise ConfigError(
            f"compensate={lam!r}: give DC-ASGD-a's λ, a positive number (under AdamW about "
            "3 / lr, e.g. 1000 at lr=3e-3), or None for no delay compensation")


def _check_correct_every(k) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ConfigError(
            f"correct_every={k!r}: give the number of steps between exact corrections, an "
            "integer >= 1 (CD-SGD's k, e.g. 10), or None for no correction")


class DelayedHookState(CommHookState):
    """What :func:`delayed_comm_hook`'s hook keeps: :class:`CommHookState`'s codec state and
    step count, plus the exchanges in flight, the averaged gradient each parameter applies at
    the next step and, with ``correct_every``, what each parameter is owed (see the module
    docstring)."""

    def __init__(self, spec: str, process_group=None, *, correct_every: int | None = None,
                 compensate: float | None = None,
                 collective_timeout_s: float = Config.collective_timeout_s):
        _check_correct_every(correct_every)
        _check_compensate(compensate)
        super().__init__(spec, process_group, "all_gather",
                         collective_timeout_s=collective_timeout_s)
        _check_delayable(self.spec)
        #: steps between exact corrections (None: never)
        self.correct_every = correct_every
        #: DC-ASGD-a's λ (None: the average is applied as it arrived)
        self.compensate = compensate
        self._flights: list[_Flight] = []
        self._stale: dict[int, torch.Tensor] = {}  # param id -> averaged gradient, next step's
        self._owed: dict[int, torch.Tensor] = {}  # param id -> fp32, owed since the correction
        self._prev: dict[int, torch.Tensor] = {}  # param id -> fp32 weights of the last step
        self._mean_sq: dict[int, torch.Tensor] = {}  # param id -> fp32 moving mean of G ⊙ G
        self._exact: dict[BucketLayout, Exchange] = {}
        self._loaded: dict[int, dict[str, Any]] = {}  # bucket index -> saved stale / owed
        self._warned_dropped = False

    def correcting(self) -> bool:
        """Whether the step being reduced is a correction step."""
        k = self.correct_every
        return k is not None and self.steps % k == k - 1

    def in_flight(self) -> int:
        """How many bucket exchanges are issued and not yet waited on."""
        return len(self._flights)

    # -- flights --------------------------------------------------------------------------------

    def comm(self, device_type: str = "cpu") -> ProcessGroupComm:
        """The hook's collectives; a CPU wait lasts at most ``collective_timeout_s``."""
        on_cpu = device_type == "cpu"  # a CUDA wait orders streams instead
        return ProcessGroupComm(self.process_group, self.collective_timeout_s if on_cpu else None)

    def land(self, params: tuple[int, ...] | None, comm: ProcessGroupComm) -> None:
        """Wait for the earlier steps' flights holding any of ``params`` (None: all), in the
        order they were issued; their averages become the parameters' ``stale`` gradients."""
        wanted = None if params is None else set(params)
        keep = []
        for flight in self._flights:
            if flight.step >= self.steps or (wanted is not None and wanted.isdisjoint(
                    flight.params)):
                keep.append(flight)
                continue
            averaged = flight.exchange.phases[-1]([], flight.state, flight.carry, comm)
            for pid, avg in zip(flight.params, averaged, strict=True):
                self._stale[pid] = avg
                if not flight.exact and self.correct_every is not None:
                    self._owed[pid].sub_(avg)
        self._flights = keep

    def launch(self, bucket: dist.GradBucket, live: _BucketState, params: tuple[int, ...],
               comm: ProcessGroupComm) -> tuple[int, int]:
        """Issue this step's exchange of ``bucket`` (compressed, or the exact correction);
        ``(raw bytes, bytes sent)``."""
        grads = bucket.gradients()
        exact = self.correcting()
        if self.correct_every is not None:
            for pid, g in zip(params, grads):
                owed = self._owed.get(pid)
                if owed is None:
                    owed = self._owed[pid] = torch.zeros_like(g, dtype=torch.float32)
                owed.add_(g)
        if exact:
            owed = [self._owed[pid] for pid in params]
            exchange = self._exact_exchange(live.layout)
            state: list[torch.Tensor] = []
            carry = exchange.phases[0](owed, state, [], comm)  # copies owed before it travels
            for t in owed:
                t.zero_()
            for name, t in live.tensors.items():  # error feedback: the correction paid it
                if name.startswith("residual"):
                    t.zero_()
        else:
            exchange = live.exchange
            state = [live.tensors[k] for k in sorted(exchange.state_layout())]
            carry = exchange.phases[0](list(grads), state, [], comm)
        self._flights.append(_Flight(self.steps, params, exchange, state, carry, exact,
                                     grads[0].device.type))
        return exchange.raw_bytes, exchange.sent_bytes()

    def _exact_exchange(self, layout: BucketLayout) -> Exchange:
        fp32 = BucketLayout(layout.shapes, torch.float32)
        if fp32 not in self._exact:
            self._exact[fp32] = exchange_for(fp32, "none")
        return self._exact[fp32]

    def take(self, bucket: dist.GradBucket, params: tuple[int, ...]) -> torch.Tensor:
        """The flat averaged gradient the bucket applies now (zeros where none waits: step 0),
        compensated for its delay with ``compensate``."""
        buffer = bucket.buffer()
        parts = []
        for pid, g, w in zip(params, bucket.gradients(), bucket.parameters()):
            stale = self._stale.pop(pid, None)
            if self.compensate is not None:
                stale = self._compensate(pid, stale, w)
            parts.append(torch.zeros(g.numel(), dtype=buffer.dtype, device=buffer.device)
                         if stale is None else stale.reshape(-1).to(buffer.dtype))
        return torch.cat(parts).view(buffer.shape)

    def _compensate(self, pid: int, stale: torch.Tensor | None,
                    w: torch.Tensor) -> torch.Tensor | None:
        """``stale`` moved from the last step's weights to ``w`` (:func:`compensated`); the
        weights and the moving mean of ``stale ⊙ stale`` kept for the next step."""
        prev = self._prev.get(pid)
        if stale is not None and prev is not None:
            g = stale.float()
            mean_sq = self._mean_sq.get(pid)
            if mean_sq is None:
                mean_sq = self._mean_sq[pid] = g * g
            else:
                mean_sq.mul_(MEAN_SQ_DECAY).addcmul_(g, g, value=1 - MEAN_SQ_DECAY)
            stale = compensated(stale, w, prev, mean_sq, self.compensate)
        self._prev[pid] = w.detach().float().clone()
        return stale

    def drain(self) -> None:
        """Wait for every exchange in flight (what a checkpoint does first)."""
        if self._flights:
            self.land(None, self.comm(self._flights[0].device))

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """:meth:`CommHookState.state_dict` after :meth:`drain`, with each bucket's ``stale``
        and ``owed`` (fp32) under ``state`` and ``{"delay": 1, "correct_every": k}`` under
        ``delayed``."""
        self.drain()
        out = super().state_dict()
        latest = max((step for step, _ in self._bucket_params.values()), default=0)
        for index, (step, ids) in self._bucket_params.items():
            if step != latest or index not in self.buckets:
                continue
            for name, store in self._stores():
                if ids and all(pid in store for pid in ids):
                    out["state"][key(ddp_channel(index), name)] = torch.cat(
                        [store[pid].detach().float().reshape(-1) for pid in ids])
        out["delayed"] = {"delay": 1, "correct_every": self.correct_every}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`CommHookState.load_state_dict` for the codec's state; each bucket's saved
        ``stale`` and ``owed`` wait for the first step's bucket of that index and layout. A
        checkpoint of the synchronous hook loads (the first step then applies zeros); one made
        with another ``correct_every`` is a :class:`~ccfx.ConfigError`."""
        saved = state.get("delayed", {}) if isinstance(state, dict) else {}
        if saved.get("correct_every", self.correct_every) != self.correct_every:
            raise ConfigError(
                f"this hook state corrects every {self.correct_every} steps, the checkpoint's "
                f"every {saved['correct_every']}: build the hook with "
                f"correct_every={saved['correct_every']!r}")
        tensors = state.get("state", {}) if isinstance(state, dict) else {}
        mine = {k: t for k, t in tensors.items() if split_key(k)[1] in dict(self._stores())}
        super().load_state_dict(
            {**state, "state": {k: t for k, t in tensors.items() if k not in mine}}
            if mine else state)
        check_finite(mine, "DDP comm hook state", fix="Resume from an earlier checkpoint.")
        self.drain()
        self._flights, self._stale, self._owed, self._loaded = [], {}, {}, {}
        self._prev, self._mean_sq = {}, {}
        by_channel = {ddp_channel(int(i)): int(i) for i in state["buckets"]}
        for k, t in mine.items():
            channel, name = split_key(k)
            index = by_channel[channel]
            entry = self._loaded.setdefault(
                index, {"layout": _saved_layout(state["buckets"][index])})
            entry[name] = t.detach().clone()

    def adopt_loaded(self, index: int, live: _BucketState, params: tuple[int, ...]) -> None:
        """At a bucket's first call after a load: its saved ``stale`` / ``owed``, per parameter,
        if the bucket still holds the saved layout (else dropped, with a warning)."""
        entry = self._loaded.pop(index, None)
        if entry is None:
            return
        if entry["layout"] != live.layout:
            self.warn_dropped(index)
            return
        for name, store in self._stores():
            if name in entry:
                for pid, part in zip(params, live.layout.unflat(entry[name]), strict=True):
                    store[pid] = part.clone()

    def _stores(self) -> tuple[tuple[str, dict[int, torch.Tensor]], ...]:
        """The per-parameter tensors a checkpoint carries, by their name in it."""
        return ((STALE, self._stale), (OWED, self._owed), (PREV, self._prev),
                (MEAN_SQ, self._mean_sq))

    def warn_dropped(self, index: int) -> None:
        """Once per state: the saved ``stale`` / ``owed`` of ``index`` fit no bucket."""
        if self._warned_dropped:
            return
        self._warned_dropped = True
        warnings.warn(
            f"ccfx.delayed_comm_hook: DDP bucket {index} holds other gradients than the "
            "checkpoint's bucket of that index, so the saved averaged gradients of the last step "
            "(and the residuals owed since the last correction) are dropped: the resumed run "
            "skips that step's update. Construct DDP with find_unused_parameters=True for a "
            "resume that reproduces an uninterrupted run exactly.", CcfxWarning, stacklevel=3)


def delayed_hook(state: DelayedHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hand DDP the average of this bucket's previous step; issue this step's exchange. No
    ``from __future__ import annotations`` here: DDP checks the annotations against the
    classes themselves."""
    live = state.bucket_state(bucket)
    params = tuple(id(p) for p in bucket.parameters())
    comm = state.comm(bucket.buffer().device.type)
    if state._loaded:
        state.adopt_loaded(bucket.index(), live, params)
    try:
        state.land(params, comm)
    except RuntimeError as e:
        raise _failed(state, bucket, live, e, step=state.steps - 1) from e
    flat = state.take(bucket, params)
    try:
        raw, sent = state.launch(bucket, live, params, comm)
    except RuntimeError as e:
        raise _failed(state, bucket, live, e) from e
    state.ledger.record_bucket(0, bucket.index(), raw, sent)
    state._bucket_params[bucket.index()] = (state.steps, params)
    if bucket.is_last():
        for index in list(state._loaded):  # saved for buckets this step did not have
            del state._loaded[index]
            state.warn_dropped(index)
        state.steps += 1
        state.ledger.count_call(0)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(flat)
    return fut


def delayed_comm_hook(spec: str, process_group=None, *, correct_every: int | None = None,
                      compensate: float | None = None,
                      collective_timeout_s: float = Config.collective_timeout_s,
                      ) -> tuple[DelayedHookState, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``: DDP's buckets are
    averaged through the codec ``spec`` one step late, the exchange overlapping the next step;
    every ``correct_every`` steps the residual travels exact (CD-SGD); ``compensate`` (λ)
    moves each average to the weights it is applied at (DC-ASGD-a). See the module
    docstring. Bad options and codecs that cannot be delayed are a :class:`~ccfx.ConfigError`
    here, not at the first backward."""
    return (DelayedHookState(spec, process_group, correct_every=correct_every,
                             compensate=compensate,
                             collective_timeout_s=collective_timeout_s), delayed_hook)
