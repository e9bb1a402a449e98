"""Compressed gossip (CHOCO-SGD): ranks average with their neighbours only, no all-reduce.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = ccfx.gossip(model, opt, spec="topk:ratio=0.05", gamma=0.5, topology="ring")
    for x, y in data:                                  # unchanged: opt.step() gossips too
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    g.consensus()                                      # only when asked: one all-reduce

Koloskova, Stich, Jaggi (ICML 2019), Algorithm 2. Rank i holds its model ``x_i`` (the
parameters, flattened to fp32) and public copies ``x̂_j`` of itself and of each neighbour j,
which every rank holding them keeps bit-identical. After each optimizer step, every ``every``-th:

1. ``q_i = Q(x_i − x̂_i)``: the codec's round trip of the difference to the public copy;
2. ``x̂_i ← x̂_i + q_i``; ``q_i``'s payload goes to every neighbour (point-to-point, one message
   each way per edge), and each neighbour's ``q_j`` comes in: ``x̂_j ← x̂_j + q_j``;
3. ``x_i ← x_i + γ Σ_j w_ij (x̂_j − x̂_i)``.

``x − x̂`` is what has not been sent yet: CHOCO's own error memory, so a biased compressor
(topk) converges too, and a codec spec with ``,ef`` is refused. Weights: uniform
``w_ij = 1/(d + 1)`` over the ``d`` distinct neighbours and self. The ring (``d = 2``; 1 for two
ranks) and the 2-D torus (``rows × cols`` = world, wrapping both ways, ``d ≤ 4``) are regular,
so W is symmetric and doubly stochastic, and step 3 preserves the mean of the ``x_i`` exactly
(up to fp32 rounding). With the identity codec ``"none"`` and γ = 1, step 3 is one step of
W-averaging: on a ring of 3 (everyone a neighbour) every rank ends at the mean.

Memory: ``1 + d`` fp32 copies of the model (x̂ of self and of each neighbour) besides the
parameters. Wire: each rank sends its payload to each of its ``d`` neighbours per gossip step:
``d × codec.wire_bytes((numel,), fp32)`` (:func:`gossip_wire_bytes`). Every rank starts from
the first rank's parameters (a broadcast) and every x̂ from them.

The exchange uses a process group of its own, made by the participants with
``collective_timeout_s``; every wait is bounded by it, and a neighbour that died or did not
gossip in time is a :class:`~ccfx.CollectiveError` naming it (:mod:`ccfx.wire.blame`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import codecs
from ..codecs import ops as _ops  # also registers torch.ops.ccfx_codecs
from ..codecs.base import Codec
from ..errors import CollectiveError, ConfigError
from ..wire import agree
from ..wire import format as _format
from ..wire.comm import wait_work

#: The tag of gossip messages: apart from a user's own point-to-point traffic on a group.
TAG = 0xC40C0

TOPOLOGIES = ("ring", "torus")


def gossip_codec(spec: str) -> Codec:
    """The codec of ``spec`` checked for gossip; :class:`~ccfx.ConfigError` when it cannot run:
    error feedback (CHOCO keeps its own), a variable-size payload, or a decode that keeps state
    (each neighbour decodes the payload on its own)."""
    from ..codecs.ef import ErrorFeedback
    from ..codecs.powersgd import PowerSGD

    codec = codecs.prototype(spec)
    why = ""
    if isinstance(codec, ErrorFeedback):
        why = ("CHOCO keeps its own error memory (x − x̂ is what has not been sent yet), so "
               "error feedback would count it twice: drop ',ef'")
    elif isinstance(codec, PowerSGD):
        why = "PowerSGD's payloads are factors of a matrix all-reduced in two rounds"
    elif codec.variable:
        why = ("its payload's size depends on the data and point-to-point messages have a "
               "fixed size: use topk for a sparse one")
    else:
        extra = sorted(set(codec.state_layout((1,), torch.float32)) - {"step"})
        if extra:
            why = (f"its decode keeps state ({', '.join(extra)}), and every neighbour decodes "
                   "the payload on its own")
    if why:
        raise ConfigError(f"codec {codec.spec!r} cannot compress gossip: {why}. Use a "
                          "codec whose decode keeps no state (int8, int4, fp8, topk, sign, qsgd, none).")
    return codec


def torus_shape(world: int, shape: Sequence[int] | None = None) -> tuple[int, int]:
    """``(rows, cols)`` of a 2-D torus of ``world`` ranks: ``shape`` checked, or the most
    nearly square factorisation with both sides ≥ 2."""
    if shape is not None:
        rows, cols = (int(s) for s in shape)
        if rows < 2 or cols < 2 or rows * cols != world:
            raise ConfigError(f"torus shape {tuple(shape)} does not fit {world} ranks: give "
                              f"(rows, cols) with rows × cols = {world}, both ≥ 2")
        return rows, cols
    rows = max((r for r in range(2, math.isqrt(world) + 1) if world % r == 0), default=0)
    if not rows:
        raise ConfigError(f"a 2-D torus needs world = rows × cols with both ≥ 2; {world} ranks "
                          "do not factor so: use topology='ring'")
    return rows, world // rows


def neighbours(rank: int, world: int, topology: str,
               shape: Sequence[int] | None = None) -> list[int]:
    """The distinct neighbours of ``rank`` (group ranks), sorted."""
    if topology not in TOPOLOGIES:
        raise ConfigError(f"unknown gossip topology {topology!r}: use one of {TOPOLOGIES}")
    if topology == "ring":
        near = {(rank - 1) % world, (rank + 1) % world}
    else:
        rows, cols = torus_shape(world, shape)
        r, c = divmod(rank, cols)
        near = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                r * cols + (c - 1) % cols, r * cols + (c + 1) % cols}
    return sorted(near - {rank})


def gossip_wire_bytes(numel: int, spec: str, world: int, topology: str = "ring",
                      shape: Sequence[int] | None = None) -> int:
    """Bytes one rank sends per gossip step: its payload to each neighbour."""
    degree = len(neighbours(0, world, topology, shape))
    return degree * int(codecs.prototype(spec).wire_bytes((numel,), torch.float32))


def check_options(gamma: float, every: int, topology: str) -> None:
    """:class:`~ccfx.ConfigError` for a γ outside (0, 1], ``every`` < 1 or an unknown
    topology."""
    if not (isinstance(gamma, (int, float)) and 0 < gamma <= 1):
        raise ConfigError(f"gossip gamma={gamma!r} is outside (0, 1]: the consensus step size; "
                          "1 for an exact codec, smaller (CHOCO's γ) for a coarse compressor")
    if not (isinstance(every, int) and every >= 1):
        raise ConfigError(f"gossip every={every!r}: give a whole number ≥ 1 of optimizer steps "
                          "between gossip steps")
    if topology not in TOPOLOGIES:
        raise ConfigError(f"unknown gossip topology {topology!r}: use one of {TOPOLOGIES}")


class Gossip:
    """CHOCO-SGD on one rank (see the module docstring); made by :func:`gossip`."""

    def __init__(self, params: Sequence[torch.nn.Parameter], spec: str, gamma: float,
                 topology: str, every: int, *, shape=None, timeout_s: float = 300.0,
                 group=None):
        check_options(gamma, every, topology)
        self.codec = gossip_codec(spec)
        self.spec, self.gamma, self.topology, self.every = spec, float(gamma), topology, every
        self.params, self.timeout_s = list(params), float(timeout_s)
        self.numel = sum(p.numel() for p in self.params)
        self.group = self._own_group(group, shape)
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.neighbours = neighbours(self.rank, self.world, topology, shape)
        self.peers = [dist.get_global_rank(self.group, r) for r in self.neighbours]
        self.weight = 1.0 / (len(self.neighbours) + 1)
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=dist.get_global_rank(self.group, 0), group=self.group)
        x = self._flat()
        #: the public copies, by group rank: this rank's and each neighbour's
        self.public = {r: x.clone() for r in [self.rank, *self.neighbours]}
        layout = self.codec.payload_layout((self.numel,), torch.float32)
        self._layout, self._spans = layout, _format.offsets(layout)
        self._state = _ops.init_state(self.codec.spec, (self.numel,), torch.float32, x.device)
        self.calls = 0  # step() calls
        self.steps = 0  # gossip steps taken
        self.wire_bytes = 0  # sent by this rank

    def _own_group(self, group, shape):
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("gossip needs a process group: call "
                              "torch.distributed.init_process_group() on every rank first")
        ranks = agree.world_ranks(group)
        if len(ranks) < 2:
            raise ConfigError("gossip needs at least 2 ranks: with world size 1 there is no "
                              "neighbour to average with (train without ccfx.gossip)")
        desc = {"params": [list(p.shape) for p in self.params], "spec": self.codec.spec,
                "gamma": self.gamma, "topology": self.topology, "every": self.every,
                "shape": list(shape) if shape is not None else None}
        return agree.group("the ranks of gossip", desc, ranks, timeout_s=self.timeout_s,
                           hint="Every rank must call ccfx.gossip on the same model with the "
                                "same options.")

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _write(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            at = 0
            for p in self.params:
                p.copy_(x[at:at + p.numel()].view_as(p))
                at += p.numel()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> None:
        """One call per optimizer step (the hook :func:`gossip` registers makes it); every
        ``every``-th call gossips."""
        self.calls += 1
        if self.calls % self.every:
            return
        x = self._flat()
        mine = self.public[self.rank]
        payload, new = torch.ops.ccfx_codecs.encode(x - mine, self.codec.spec, self._state)
        for s, n in zip(self._state, new):
            s.copy_(n)
        mine += self._decode(payload)
        got = self._exchange(_format.pack(payload, self._spans, x.device))
        pull = torch.zeros_like(x)
        for r, buf in got.items():
            copy = self.public[r]
            copy += self._decode(_format.unpack(buf, self._layout, self._spans))
            pull += copy - mine
        x.add_(pull, alpha=self.gamma * self.weight)
        self._write(x)
        self.steps += 1

    def _decode(self, payload) -> torch.Tensor:
        scratch = [t.clone() for t in self._state]
        out, _ = torch.ops.ccfx_codecs.decode(list(payload), self.codec.spec, [self.numel],
                                              torch.float32, scratch)
        return out

    def _exchange(self, buf: torch.Tensor) -> dict[int, torch.Tensor]:
        """``buf`` to every neighbour, each neighbour's buffer back (by group rank)."""
        works, got = [], {}
        for r, peer in zip(self.neighbours, self.peers):
            got[r] = torch.empty_like(buf)
            try:
                works.append(("sending to", peer,
                              dist.isend(buf, dst=peer, group=self.group, tag=TAG)))
                works.append(("waiting for", peer,
                              dist.irecv(got[r], src=peer, group=self.group, tag=TAG)))
            except RuntimeError as e:
                raise self._failed("posting a message to", peer, e) from e
        for what, peer, work in works:
            try:
                wait_work(work, self.timeout_s)
            except RuntimeError as e:
                raise self._failed(what, peer, e) from e
        self.wire_bytes += buf.numel() * len(self.peers)
        return got

    def _failed(self, what: str, peer: int, e: BaseException) -> CollectiveError:
        first, who = agree.failed(f"gossip step {self.steps + 1}", e, self.peers)
        return CollectiveError(
            f"rank {dist.get_rank()}: gossip step {self.steps + 1} ({self.topology}, "
            f"{self.codec.spec!r}) failed {what} neighbour rank {peer} (timeout "
            f"{self.timeout_s:g} s): {first}.{who} A neighbour died, hung past "
            "collective_timeout_s, or took a different number of optimizer steps")

    # -- inspection ---------------------------------------------------------------------------

    def consensus(self) -> float:
        """Mean over ranks of ``||x_i − x̄||² / ||x̄||²`` (x̄ the mean model): one fp64
        all-reduce of the model and its squared norm. Every rank calls it at the same point."""
        x = self._flat().double()
        both = torch.cat([x, (x * x).sum().reshape(1)])
        dist.all_reduce(both, group=self.group)
        mean = both[:-1] / self.world
        norm = float((mean * mean).sum())
        spread = float(both[-1]) / self.world - norm  # mean of ||x_i||² − ||x̄||²
        return max(spread, 0.0) / norm if norm > 0 else float("inf")

    @property
    def bytes_per_step(self) -> float:
        """Bytes this rank sent per :meth:`step` call so far."""
        return self.wire_bytes / max(self.calls, 1)

    def close(self) -> None:
        """Stop gossiping after optimizer steps (removes the hook, if any)."""
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
            self._hook = None

    def __repr__(self) -> str:
        return (f"Gossip({self.topology}, codec={self.codec.spec!r}, gamma={self.gamma:g}, "
                f"every={self.every}, rank={self.rank}, neighbours={self.neighbours}, "
                f"world={self.world}, steps={self.steps})")


def gossip(model: torch.nn.Module, optimizer=None, *, spec: str = "topk:ratio=0.05",
           gamma: float = 0.5, topology: str = "ring", every: int = 1, shape=None,
           collective_timeout_s: float = 300.0, group=None) -> Gossip:
    """CHOCO-SGD over ``model``'s trainable parameters (see the module docstring). With an
    ``optimizer``, each of its steps is followed by :meth:`Gossip.step` (a step post-hook);
    without, call ``step()`` after each optimizer step. ``shape``: the torus's ``(rows, cols)``.
    Every rank of ``group`` (default: the world) calls it."""
    check_options(gamma, every, topology)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"ccfx.gossip takes an nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no parameters that require grad: nothing to gossip")
    if optimizer is not None:
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(id(p) not in trained for p in params):
            raise ConfigError("some parameters that require grad are not in the optimizer: "
                              "gossip averages what the optimizer trains; give it all of them")
    g = Gossip(params, spec, gamma, topology, every, shape=shape,
               timeout_s=collective_timeout_s, group=group)
    if optimizer is not None:
        g._hook = optimizer.register_step_post_hook(lambda *_: g.step())
    return g
