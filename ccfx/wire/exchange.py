"""How one gradient bucket is averaged across ranks through a codec, as plain torch phases.

A bucket's exchange is a short list of *phases*. Each phase is a function of tensors only:

    phase(grads, state, carry, comm) -> carry'      (the last phase returns the averaged grads)

``grads`` are the bucket's local gradients, ``state`` the codec's state tensors (updated in
place with ``copy_``), ``carry`` what the previous phase handed on (collective handles, the
orthogonalised P). ``comm`` issues collectives and waits on them. Written this way the same
code serves every runtime (the ``Comm`` classes are in :mod:`ccfx.wire.comm`):

* ``passes.grad_buckets`` traces each phase with ``make_fx`` over the functional collectives
  (``FunctionalComm``) and splices phase 0 right after the bucket's last gradient, the middle
  phases after later buckets' gradients and the last one just before the backward's output:
  collectives start as soon as a bucket is ready and are waited on as late as possible;
* ``ProcessGroupComm`` runs them eagerly on a process group (the DDP comm hook, the pipeline's
  data-parallel gradients, local steps' outer sync);
* ``LocalComm`` (world size 1, no process group) makes the same phases a local round trip
  through the codec, so one process computes what the codec does to training.

The codecs run as their own ops (``ccfx_codecs::encode`` / ``decode``, PowerSGD's
``powersgd_p`` / ``powersgd_q``): one implementation of each codec for the simulation, the
buckets and the pipeline, Triton on CUDA, the torch reference on CPU.

Kinds of exchange, chosen from the codec's ``reduction``:

* :class:`AllReduceExchange` (``none``, ``fp16``, ``bf16``): payloads are summed by an
  all-reduce; casts divide by the world size first (as DDP's fp16 hook: no overflow).
* :class:`GatherExchange` (``int8``, ``sign``, ``topk``, ...): each rank's payload is
  all-gathered, every rank decodes every payload and sums them in rank order, so all ranks end
  with the same bits. Error feedback, if asked, is local (EF-SGD).
* :class:`RingExchange` (the same codecs, ``collective="ring"``): :mod:`ccfx.wire.ring`'s
  re-encoding ring, ``2 (W-1) / W`` of a payload per rank instead of ``W-1``, still the same
  bits on every rank. Point to point is not a functional collective: each ``Comm`` has a
  ``ring`` method (the ``ccfx::ring_all_reduce`` op when traced, the eager function on a
  process group, the codec's round trip at world size 1).
* :class:`PowerSGDExchange`: P = M Q all-reduced, orthogonalised, Q = Mᵀ P all-reduced,
  M ≈ P Qᵀ / world; the averaged Q is kept as the next step's warm start (the same on every
  rank) and error feedback keeps ``compensated − result``, as ``powerSGD_hook`` does.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import codecs
from ..codecs import ops as _ops  # noqa: F401  (registers torch.ops.ccfx_codecs)
from ..codecs.powersgd import PowerSGD
from ..errors import ConfigError
from . import ring as _ring
from .comm import ProcessGroupComm

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class BucketLayout:
    """The gradients of one bucket: their shapes and common dtype."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def flat(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in grads])

    def unflat(self, flat: torch.Tensor) -> Tensors:
        return [part.view(shape) for part, shape in zip(flat.split(self.numels), self.shapes)]


class Exchange(abc.ABC):
    """Base class: a bucket's codec as phases (see the module docstring). A subclass gives
    ``phases`` and ``wire_bytes``; stateful ones ``state_layout`` (and ``init_state`` when
    zeros are not the right start)."""

    collective = ""

    def __init__(self, layout: BucketLayout, spec: str):
        self.layout = layout
        self.spec = spec

    @property
    @abc.abstractmethod
    def phases(self) -> list[Callable]:
        """The phase functions, in order (the last returns the averaged gradients)."""

    def state_layout(self) -> dict[str, tuple[tuple, torch.dtype]]:
        return {}

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        return {k: torch.zeros(s, dtype=d, device=device)
                for k, (s, d) in self.state_layout().items()}

    @abc.abstractmethod
    def wire_bytes(self) -> int:
        """Payload bytes this rank contributes per step (exact)."""

    def sent_bytes(self) -> int:
        """Bytes this rank sent in its last run: ``wire_bytes()`` but where the payload's size
        depends on the data and the run could send less (:class:`GatherExchange`)."""
        return self.wire_bytes()

    @property
    def raw_bytes(self) -> int:
        return self.layout.numel * self.layout.dtype.itemsize

    def run(self, grads: Sequence[torch.Tensor], state: dict[str, torch.Tensor], comm) -> Tensors:
        """All phases one after the other (eager use and tests)."""
        names = sorted(self.state_layout())
        state_list = [state[k] for k in names]
        carry: Tensors = []
        for phase in self.phases:
            carry = phase(list(grads), state_list, carry, comm)
        return carry


class _FlatExchange(Exchange):
    """A codec applied to the bucket flattened into one 1-D tensor."""

    def __init__(self, layout, spec):
        super().__init__(layout, spec)
        self.codec = codecs.prototype(spec)
        self.payload = self.codec.payload_layout((layout.numel,), layout.dtype)

    def state_layout(self):
        return self.codec.state_layout((self.layout.numel,), self.layout.dtype)

    def wire_bytes(self):
        return int(self.codec.wire_bytes((self.layout.numel,), self.layout.dtype))

    @property
    def phases(self):
        return [self._issue, self._finish]

    def _encode(self, flat, state) -> Tensors:
        payload, new = torch.ops.ccfx_codecs.encode(flat, self.spec, state)
        for s, n in zip(state, new):
            s.copy_(n)
        return payload


class AllReduceExchange(_FlatExchange):
    collective = "all_reduce"

    def _identity(self) -> bool:
        return self.codec.name == "none"

    def _issue(self, grads, state, carry, comm):
        flat = self.layout.flat(grads)
        if self._identity():
            return [comm.all_reduce(flat)]
        return [comm.all_reduce(p) for p in self._encode(flat / comm.world, state)]

    def _finish(self, grads, state, carry, comm):
        summed = [comm.wait(h) for h in carry]
        if self._identity():
            return self.layout.unflat(summed[0] / comm.world)
        flat, new = torch.ops.ccfx_codecs.decode(summed, self.spec, [self.layout.numel],
                                                 self.layout.dtype, state)
        for s, n in zip(state, new):  # randomk counts its decodes
            s.copy_(n)
        return self.layout.unflat(flat)


class GatherExchange(_FlatExchange):
    """Every rank's payload all-gathered, decoded and summed in rank order.

    A ``variable`` codec (``tlc``) over a process group (:class:`ProcessGroupComm`, eager)
    sends only what its payloads use: the ranks all-gather their used lengths first (4 bytes
    each), then ``payload[0]`` cut to the longest (shorter ones padded to it) and the other
    payload tensors whole; ``sent_bytes()`` counts that. Traced (:class:`FunctionalComm`,
    static shapes) and local exchanges send the capacity, as for any codec."""

    collective = "all_gather"

    def __init__(self, layout, spec):
        super().__init__(layout, spec)
        self._sent: int | None = None

    def sent_bytes(self) -> int:
        return self.wire_bytes() if self._sent is None else self._sent

    def _issue(self, grads, state, carry, comm):
        payload = self._encode(self.layout.flat(grads), state)
        if self._cut(comm):
            return self._issue_used(payload, comm)
        return [comm.all_gather(p) for p in payload]

    def _cut(self, comm) -> bool:
        """Whether this run sends a variable payload cut to its used length."""
        return self.codec.variable and isinstance(comm, ProcessGroupComm)

    def _issue_used(self, payload, comm):
        used = torch.tensor([self.codec.used_elements(payload)], dtype=torch.int32,
                            device=payload[0].device)
        longest = int(comm.wait(comm.all_gather(used)).max())
        head = payload[0].reshape(-1)[:longest]
        self._sent = (used.nbytes + head.nbytes
                      + sum(p.numel() * p.element_size() for p in payload[1:]))
        return [comm.all_gather(head), *(comm.all_gather(p) for p in payload[1:])]

    def _finish(self, grads, state, carry, comm):
        if self._cut(comm):
            gathered = [comm.wait(h).view(comm.world, -1) for h in carry]
            capacity = int(self.payload[0][0][0])  # padded back: decode takes the layout
            gathered[0] = torch.nn.functional.pad(gathered[0],
                                                  (0, capacity - gathered[0].shape[1]))
        else:
            gathered = [comm.wait(h).view(comm.world, *shape)
                        for h, (shape, _) in zip(carry, self.payload)]
        total = None
        # Rank order: every rank sums the same way. Decode's state is read, not kept: the
        # gather codecs (int8, sign, topk, qsgd, ...) keep no state on the decode side.
        for rank in range(comm.world):
            part, _ = torch.ops.ccfx_codecs.decode([g[rank] for g in gathered], self.spec,
                                                   [self.layout.numel], self.layout.dtype, state)
            part = part.float()
            total = part if total is None else total + part
        return self.layout.unflat((total / comm.world).to(self.layout.dtype))


class RingExchange(_FlatExchange):
    """A non-summable codec averaged on :mod:`ccfx.wire.ring`'s re-encoding ring: every
    hop of the reduce-scatter re-encodes a partial sum (accumulated in fp32), the owners' final
    payloads go round unchanged, every rank decodes the same bytes.

    Two phases, as the other exchanges: the first runs the whole ring (it blocks: point to point
    has no handle to wait on later), right after the bucket's last gradient, so buckets whose
    all-reduces were issued earlier travel meanwhile; the second hands the result out.
    ``wire_bytes`` is one payload of the bucket, as for the all-gather (the chunks' payloads add
    up to it for blockwise codecs); the ring sends ``2 (W-1) / W`` of that per rank
    (:func:`ccfx.wire.ring.ring_wire_bytes`). Error feedback keeps each rank's local
    quantisation error (see :mod:`ccfx.wire.ring`)."""

    collective = "ring"

    def __init__(self, layout, spec):
        super().__init__(layout, spec)
        _ring.ring_codec(spec)  # ConfigError now, not at the first backward

    def _issue(self, grads, state, carry, comm):
        out, new = comm.ring(self.layout.flat(grads), self.spec, state)
        for s, n in zip(state, new):
            s.copy_(n)
        return [out]

    def _finish(self, grads, state, carry, comm):
        return self.layout.unflat(carry[0])


class PowerSGDExchange(Exchange):
    """PowerSGD over a bucket: each matrix compressed on its own (as ``powerSGD_hook``),
    P's and Q's each concatenated into one all-reduce; tensors where low rank does not pay
    travel raw in a third all-reduce."""

    collective = "powersgd"

    def __init__(self, layout, spec):
        super().__init__(layout, spec)
        codec = codecs.prototype(spec)
        self.error_feedback = codec.name == "ef"
        self.codec: PowerSGD = getattr(codec, "inner", codec)
        self.mats = [i for i, s in enumerate(layout.shapes) if self.codec.matrix(s) is not None]
        self.raw = [i for i in range(len(layout.shapes)) if i not in self.mats]

    # state: q<i> per matrix (the warm start), residual<i> per matrix with error feedback
    def state_layout(self):
        out = {}
        for i in self.mats:
            _, cols, r = self.codec.matrix(self.layout.shapes[i])
            out[f"q{i:04d}"] = ((cols, r), torch.float32)
            if self.error_feedback:
                out[f"residual{i:04d}"] = (self.layout.shapes[i], self.layout.dtype)
        return out

    def init_state(self, device=None):
        """Q's drawn in bucket order from one generator seeded with ``seed``: what
        ``powerSGD_hook`` draws for a bucket (its per-bucket seed given as ``seed``)."""
        state = super().init_state(device)
        g = torch.Generator().manual_seed(self.codec.seed)
        for i in self.mats:
            _, cols, r = self.codec.matrix(self.layout.shapes[i])
            state[f"q{i:04d}"].copy_(torch.randn(cols, r, generator=g))
        return state

    def wire_bytes(self):
        item = self.layout.dtype.itemsize
        total = sum(self.layout.numels[i] for i in self.raw) * item
        for i in self.mats:
            rows, cols, r = self.codec.matrix(self.layout.shapes[i])
            total += (rows + cols) * r * item
        return total

    @property
    def phases(self):
        return [self._issue_p, self._issue_q, self._finish]

    def _split_state(self, state):
        names = sorted(self.state_layout())
        named = dict(zip(names, state))
        qs = [named[f"q{i:04d}"] for i in self.mats]
        res = [named[f"residual{i:04d}"] for i in self.mats] if self.error_feedback else None
        return qs, res

    def _compensated(self, grads, res):
        mats = [grads[i] for i in self.mats]
        return [m + r for m, r in zip(mats, res)] if res is not None else mats

    def _issue_p(self, grads, state, carry, comm):
        qs, res = self._split_state(state)
        ms = self._compensated(grads, res)
        ps = []
        for m, q in zip(ms, qs):
            p, q_used = torch.ops.ccfx_codecs.powersgd_p(m, q, self.codec.spec)
            q.copy_(q_used)
            ps.append(p)
        handles = [comm.all_reduce(torch.cat([p.reshape(-1) for p in ps]))] if ps else []
        if self.raw:
            handles.append(comm.all_reduce(torch.cat([grads[i].reshape(-1) for i in self.raw])))
        return handles

    def _issue_q(self, grads, state, carry, comm):
        _, res = self._split_state(state)
        out: Tensors = []
        if self.mats:
            ms = self._compensated(grads, res)
            p_sum = comm.wait(carry[0])
            sizes = [self.codec.matrix(m.shape)[0] * self.codec.matrix(m.shape)[2] for m in ms]
            p_orths, q_locals = [], []
            for m, p in zip(ms, p_sum.split(sizes)):
                rows, _, r = self.codec.matrix(m.shape)
                p_orth, q = torch.ops.ccfx_codecs.powersgd_q(m, p.view(rows, r), self.codec.spec)
                p_orths.append(p_orth)
                q_locals.append(q)
            out.append(comm.all_reduce(torch.cat([q.reshape(-1) for q in q_locals])))
            out += p_orths
        if self.raw:
            out.append(carry[-1])
        return out

    def _finish(self, grads, state, carry, comm):
        qs, res = self._split_state(state)
        result: list[torch.Tensor | None] = [None] * len(self.layout.shapes)
        if self.mats:
            q_avg = comm.wait(carry[0]) / comm.world
            p_orths = carry[1:1 + len(self.mats)]
            ms = self._compensated(grads, res)
            offset = 0
            for k, (i, m, p, q_state) in enumerate(zip(self.mats, ms, p_orths, qs)):
                n = q_state.numel()
                q = q_avg[offset:offset + n].view(q_state.shape)
                offset += n
                q_state.copy_(q)
                approx = (p @ q.T).view(m.shape).to(self.layout.dtype)
                if res is not None:
                    err = m - approx
                    res[k].copy_(torch.where(torch.isfinite(err), err, torch.zeros_like(err)))
                result[i] = approx
        if self.raw:
            raw = comm.wait(carry[-1]) / comm.world
            sizes = [self.layout.numels[i] for i in self.raw]
            for i, part in zip(self.raw, raw.split(sizes)):
                result[i] = part.view(self.layout.shapes[i])
        return result


#: What ``collective`` may be in :func:`exchange_for` (``"auto"`` is resolved before, by
#: :func:`ccfx.wire.link.choose_collective`: it needs the world size and the link).
COLLECTIVES = ("all_gather", "ring")


def exchange_for(layout: BucketLayout, spec: str, collective: str = "all_gather") -> Exchange:
    """The exchange a codec spec calls for (its ``reduction``; PowerSGD its own).
    ``collective`` says how non-summable payloads are averaged: ``"all_gather"`` or
    ``"ring"``; summable codecs all-reduce and PowerSGD keeps its own, whichever is asked."""
    if collective not in COLLECTIVES:
        raise ConfigError(
            f"collective={collective!r}: choose one of {', '.join(COLLECTIVES)} (resolve 'auto' "
            "with ccfx.wire.link.choose_collective, which knows the world and the link)")
    codec = codecs.prototype(spec)
    inner = getattr(codec, "inner", codec)
    if isinstance(inner, PowerSGD):
        return PowerSGDExchange(layout, spec)
    if codec.reduction == "sum":
        return AllReduceExchange(layout, spec)
    if collective == "ring":
        return RingExchange(layout, spec)
    return GatherExchange(layout, spec)
