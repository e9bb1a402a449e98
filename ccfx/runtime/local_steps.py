"""Local steps with an outer optimizer (DiLoCo), streamed in fragments (Streaming DiLoCo).

    compiled = torch.compile(model, backend="ccfx",
                             options={"sync_every": 50, "outer_codec": "int8"})
    opt = torch.optim.AdamW(compiled.parameters(), lr=3e-4)
    outer = ccfx.local_steps(compiled, opt)          # the one line a training loop gains
    for x, y in data:                                # unchanged: its own optimizer, LR schedule
        loss_fn(compiled(x), y).backward(); opt.step(); opt.zero_grad()

Every replica (a rank of the default process group, or under PP × DP a stage's data-parallel
group) takes ``sync_every`` = H steps of its own optimizer. Then, for each fragment of the
parameters, the pseudo-gradient ``global - local`` (fp32) is averaged over the replicas through
``outer_codec`` by the gradient buckets' own exchanges (:mod:`ccfx.wire.exchange`: all-reduce for
sum-compatible codecs, an all-gather or a re-encoding ring for the others, PowerSGD its own),
an outer SGD (DiLoCo: lr 0.7, momentum 0.9, Nesterov) steps the fp32 global parameters with it,
and every replica takes the result. The averaged bytes are identical on every rank, so the
global parameters are too, bit for bit.

Streaming (``fragments`` = P > 1): the parameters are split into P fragments of about equal
size (:func:`ccfx.wire.policy.balanced`), and fragment f syncs every H steps at offset (f + 1)·H/P: the link carries a fragment
every H/P steps instead of the whole model every H. With ``fragment_delay`` = τ > 0 a
fragment's exchange runs on a background thread while the replica takes τ more inner steps; its
result is merged at the τ-th: ``local ← (1 - α)·global + α·local`` (``fragment_alpha``).

The hook. :func:`local_steps` registers a step post-hook on the user's optimizer
(``Optimizer.register_step_post_hook``): nothing else in the loop changes, and a scheduler
stepping that optimizer works as before (the inner optimizer's state stays per replica, as in
DiLoCo). The sync uses a process group of its own (created here, over the replicas, with
``collective_timeout_s``), so the background exchange never interleaves with the user's own
collectives; a sync that does not finish in time is a :class:`CollectiveError` naming the rank,
the fragment and the step it started at. Making that group is itself bounded by the timeout:
every replica calls :func:`local_steps` within ``collective_timeout_s`` of the others.

State (:meth:`LocalSteps.state_dict`): the inner step count, per fragment the global parameters,
the outer optimizer's momentum and the codec state (error-feedback residuals, PowerSGD's Q: each
part's exchange makes it with ``init_state`` and updates it in place; saved under ``"codec"`` as
``outer.fragment<f>.part<p>.<state-name>``, :mod:`ccfx.codecs.state`),
the result of an exchange still in flight (so a checkpoint taken between a fragment's sync and
its merge resumes with identical numerics), and this replica's own parameters: a new
``local_steps`` starts by giving every replica the first one's parameters, which between two
syncs are not this replica's. Save it beside the optimizer's; to resume, make the model and
optimizer, call ``local_steps``, then load the optimizer's state and this one. What the state
was made for rides with it: the outer options, the number of replicas and this replica's rank
among them (its parameters and residuals are its own: a checkpoint loaded on another replica or
world size is a :class:`~ccfx.ConfigError`; one saved before ccfx recorded them loads without
that check), the fragments' parameter names and shapes.

Fault tolerant (``fault_tolerant=True``, with ``lighthouse``, ``replica_id``, ``min_replicas``,
``quorum_timeout_s``, ``max_retries``, ``trainers``, ``slot``, ``init_sync``,
``lighthouse_outage_s``): each sync is a
step of a torchft ``Manager`` among the replicas alive now, and a replica that joins late
recovers from a live peer; with ``trainers=N`` the replicas beyond N are hot spares that take a
dead trainer's place (:attr:`LocalSteps.slot`) when it dies; see :mod:`ccfx.runtime.elastic`.
``outer.add_tokens(n)`` weights the average by tokens.
"""

from __future__ import annotations

import concurrent.futures
import logging
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs.state import check, check_finite, check_place, named, outer_channel
from ..config import Config
from ..errors import CollectiveError, ConfigError
from ..wire import agree
from ..wire.comm import LocalComm, ProcessGroupComm
from ..wire.exchange import BucketLayout, exchange_for
from ..wire.link import resolve_collective
from ..wire.policy import balanced, split_fragment
from ..wire.ring import PEER_HINT
from .fragments import Fragment, InFlight, Part
from .launcher_env import require_group_under_launcher

log = logging.getLogger("ccfx")

_Part, _InFlight = Part, InFlight  # their former names here


class LocalSteps:
    """The outer loop of one replica (see the module docstring); made by :func:`local_steps`."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], optimizer,
                 config: Config, group=None, ledger=None, elastic=None):
        if config.sync_every is None:
            raise ConfigError("local steps need sync_every=H (inner steps between syncs): pass "
                              "it in torch.compile's options or to ccfx.local_steps()")
        if not named_params:
            raise ConfigError("the model has no parameters that require grad: nothing to sync")
        self.config = config
        self.sync_every = config.sync_every
        self.ledger = ledger
        self.step = 0  # inner optimizer steps taken
        self.syncs = 0  # fragment exchanges merged
        self.raw_bytes = 0  # pseudo-gradient bytes averaged, raw (fp32) and on the wire
        self.wire_bytes = 0
        # fault tolerant (ccfx.runtime.elastic): torchft's quorum, not a process group
        started = elastic is None and dist.is_available() and dist.is_initialized()
        if elastic is None:
            require_group_under_launcher("ccfx.local_steps")
        self.group = self._own_group(group, named_params) if started else None
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank() if started else 0
        self._broadcast_from_first([p for _, p in named_params])
        h, count = config.sync_every, config.fragments
        #: the parameters' shapes, in the model's order (what the planner prices:
        #: :func:`ccfx.planner.predict_outer`)
        self.shapes = [tuple(p.shape) for _, p in named_params]
        self.fragments: list[Fragment] = []
        for f, members in enumerate(balanced([p.numel() for _, p in named_params], count)):
            local = [named_params[k][1] for k in members]
            global_ = [p.detach().float().clone() for p in local]
            nesterov = config.outer_nesterov and config.outer_momentum > 0
            outer = torch.optim.SGD(global_, lr=config.outer_lr, momentum=config.outer_momentum,
                                    nesterov=nesterov)
            frag = Fragment(f, [named_params[k][0] for k in members], local, global_, outer,
                            offset=((f + 1) * h // count) % h)
            frag.parts = self._parts_of(frag)
            self.fragments.append(frag)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ccfx-outer-sync") if config.fragment_delay else None
        self.elastic = None
        if elastic is not None:
            from .elastic import Elastic

            self.elastic = Elastic(self, elastic, {**_outer_options(config), "compress_min_numel":
                                                   config.compress_min_numel})
        self._hook = optimizer.register_step_post_hook(self._after_step)
        self.optimizer = optimizer

    # -- setup ----------------------------------------------------------------------------------

    def _own_group(self, group, named_params):
        """A process group over the replicas for the sync alone: a background exchange must not
        interleave with collectives the training loop issues on its own groups. The replicas
        agree on what they sync (the parameters' names and shapes, the outer options) and the
        group is named by its fingerprint (:func:`ccfx.wire.agree.group`), made by the replicas
        only: it does not depend on the groups or models a rank made before. None for a single
        replica."""
        desc = {"params": [[n, list(p.shape), str(p.dtype)] for n, p in named_params],
                "options": _outer_options(self.config)}
        return agree.group(
            "the replicas of local steps", desc, agree.world_ranks(group),
            timeout_s=self.config.collective_timeout_s,
            hint="Every replica must call ccfx.local_steps on the same model with the same "
                 "options.")

    def _collective(self, spec: str, numel: int) -> str:
        """``outer_collective``, "auto" resolved by bytes (the same answer on every replica)."""
        return resolve_collective(self.config.outer_collective, spec, numel, torch.float32,
                                  self.world)

    def _broadcast_from_first(self, params: list[torch.nn.Parameter]) -> None:
        """Replicas start from the first replica's parameters (as DDP does at construction)."""
        if self.world < 2:
            return
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=src, group=self.group)

    def _parts_of(self, frag: Fragment) -> list[Part]:
        parts = []
        shapes = [tuple(p.shape) for p in frag.local]
        for members, spec in split_fragment(shapes, self.config.outer_codec,
                                            self.config.compress_min_numel):
            layout = BucketLayout(tuple(shapes[i] for i in members), torch.float32)
            exchange = exchange_for(layout, spec, self._collective(spec, layout.numel))
            parts.append(Part(members, exchange, exchange.init_state(frag.local[0].device)))
        return parts

    # -- the loop -------------------------------------------------------------------------------

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        if self.elastic is not None:
            due = [f for f in self.fragments if self.step % self.sync_every == f.offset]
            if due or self.elastic.catch_up_due():
                self.elastic.sync(due)
                self.elastic.wait_while_spare()  # a trainer whose place a spare took
            return
        for frag in self.fragments:
            flight = frag.in_flight
            if flight is not None and self.step >= flight.merge_at:
                self._merge(frag)
        for frag in self.fragments:
            if self.step % self.sync_every == frag.offset:
                self._start(frag)

    def _start(self, frag: Fragment) -> None:
        with torch.no_grad():
            delta = [g - p.detach().float() for g, p in zip(frag.global_, frag.local)]
        flight = InFlight(self.step, self.step + self.config.fragment_delay)
        if self._pool is None:
            try:
                flight.averaged = self._exchange(frag, delta)
            except Exception as e:  # a peer died, hung past the timeout, or diverged
                raise self._failed(frag, flight, e) from e
            frag.in_flight = flight
            self._merge(frag)
        else:
            flight.future = self._pool.submit(self._exchange, frag, delta)
            frag.in_flight = flight

    def _exchange(self, frag: Fragment, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averaged pseudo-gradient of one fragment (runs on the sync thread when τ > 0)."""
        comm = LocalComm() if self.world < 2 else _comm(self.group)
        out: list[torch.Tensor | None] = [None] * len(delta)
        for part in frag.parts:
            averaged = part.exchange.run([delta[i] for i in part.members], part.state, comm)
            for i, a in zip(part.members, averaged, strict=True):
                out[i] = a.float()
        return out

    def _merge(self, frag: Fragment) -> None:
        flight = frag.in_flight
        if flight.averaged is None:
            flight.averaged = self._wait(frag, flight)
        frag.in_flight = None
        for g, a in zip(frag.global_, flight.averaged):
            g.grad = a
        frag.outer.step()
        alpha = self.config.fragment_alpha
        with torch.no_grad():
            for p, g in zip(frag.local, frag.global_):
                g.grad = None
                p.copy_(g if alpha == 0 else torch.lerp(g, p.float(), alpha))
        self.syncs += 1
        raw = sum(t.numel() for t in frag.global_) * 4
        wire = sum(part.exchange.sent_bytes() for part in frag.parts)
        self.raw_bytes += raw
        self.wire_bytes += wire
        ledger = self.ledger() if callable(self.ledger) else self.ledger
        if ledger is not None:
            ledger.record_outer(frag.index, raw, wire)

    def _wait(self, frag: Fragment, flight: InFlight) -> list[torch.Tensor]:
        timeout = self.config.collective_timeout_s
        try:
            return flight.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise CollectiveError(
                f"rank {self.rank}: the outer sync of fragment {frag.index} (started at inner "
                f"step {flight.started}) did not finish within collective_timeout_s={timeout:g} "
                "s: a replica died, hangs, or took a different number of optimizer steps"
            ) from None
        except Exception as e:
            raise self._failed(frag, flight, e) from e

    def _failed(self, frag: Fragment, flight: InFlight, e: BaseException) -> CollectiveError:
        """The error of a failed outer sync: the fragment, the step it started at, what failed
        (gloo's line, or the ring's own error: its hop and peer) and the replica it points at."""
        where = (f"rank {self.rank}: the outer sync of fragment {frag.index} (started at inner "
                 f"step {flight.started})")
        if isinstance(e, CollectiveError) and str(e).startswith(where):
            return e
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        text = text.removesuffix(PEER_HINT).rstrip(" .")  # said below, for a replica
        from ..wire import agree

        agree.gave_up(f"the outer sync of fragment {frag.index}", text)
        who = agree.blame(e)
        who = f" {who[0].upper()}{who[1:]}." if who else ""
        return CollectiveError(
            f"{where} failed: {text}.{who} A replica died, hung past "
            f"collective_timeout_s={self.config.collective_timeout_s:g} s, or took a different "
            "number of optimizer steps")

    def finish(self) -> None:
        """Merge every exchange still in flight (before evaluating or saving the final model)."""
        for frag in self.fragments:
            if frag.in_flight is not None:
                self._merge(frag)

    def close(self) -> None:
        """Finish, stop the hook and the sync thread; the optimizer goes back to plain steps."""
        self.finish()
        self._hook.remove()
        if self.elastic is not None:
            self.elastic.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def add_tokens(self, n: int) -> None:
        """Fault tolerant: ``n`` more tokens trained since the last sync; the outer average
        weights each replica by them (by inner steps if it never reports)."""
        if self.elastic is None:
            raise ConfigError("add_tokens weights the fault-tolerant sync: local_steps(..., "
                              "fault_tolerant=True)")
        self.elastic.add_tokens(n)

    # -- inspection -----------------------------------------------------------------------------

    @property
    def slot(self) -> int | None:
        """Fault tolerant with ``trainers=N``: the training place this replica holds (0 .. N-1:
        which shard of the data to read, from inner step :attr:`step`); it may change after
        an optimizer step (a replica that lost its place waits there as a spare until it holds
        another). None without ``trainers``."""
        return self.elastic.slot if self.elastic is not None else None

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The fp32 global parameters every replica agrees on, by name."""
        return {n: g for f in self.fragments for n, g in zip(f.names, f.global_)}

    @property
    def bytes_per_step(self) -> float:
        """Wire bytes of pseudo-gradient this rank contributed per inner step so far."""
        return self.wire_bytes / max(self.step, 1)

    @property
    def collectives(self) -> list[str]:
        """How each fragment's compressed part is averaged ("all_reduce", "all_gather", "ring",
        "powersgd"), fragment by fragment."""
        return [f.parts[0].exchange.collective for f in self.fragments]

    def __repr__(self) -> str:
        return (f"LocalSteps(sync_every={self.sync_every}, codec={self.config.outer_codec!r}, "
                f"collectives={self.collectives!r}, fragments={len(self.fragments)}, "
                f"delay={self.config.fragment_delay}, world={self.world}, step={self.step})")

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything the outer loop needs to resume with identical numerics (an exchange in
        flight is waited for and its result saved, to be merged at the same step)."""
        frags = []
        for frag in self.fragments:
            flight = frag.in_flight
            pending = None
            if flight is not None:
                if flight.averaged is None:
                    flight.averaged = self._wait(frag, flight)
                pending = {"started": flight.started, "merge_at": flight.merge_at,
                           "averaged": [a.clone() for a in flight.averaged]}
            frags.append({
                "names": list(frag.names),
                "global": [g.clone() for g in frag.global_],
                "local": [p.detach().clone() for p in frag.local],
                "outer": frag.outer.state_dict(),
                "pending": pending,
            })
        return {"step": self.step, "syncs": self.syncs, "raw_bytes": self.raw_bytes,
                "wire_bytes": self.wire_bytes, "config": _outer_options(self.config),
                "world_size": self.world, "rank": self._replica(),
                "fragments": frags,
                "codec": {k: t.clone() for k, t in self._codec_state().items()}}

    def _codec_state(self) -> dict[str, torch.Tensor]:
        """Every part's codec state tensors (live), by checkpoint name."""
        return {k: t for frag in self.fragments for p, part in enumerate(frag.parts)
                for k, t in named(outer_channel(frag.index, p), part.state).items()}

    def _replica(self) -> int:
        """This replica's rank among the replicas (0 without a process group)."""
        return dist.get_rank(self.group) if self.group is not None else 0

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`. What it was made for is checked first, each a
        :class:`~ccfx.ConfigError` saying what differs: the outer options, the number of
        replicas and this replica's rank among them (this replica's parameters and
        error-feedback residuals are its own), the fragments' parameters and their shapes, the
        codec state's names and shapes, and that it holds no NaN or ±inf (a damaged file). A
        checkpoint saved before ccfx recorded the world size and rank loads without that
        check."""
        saved, now = state["config"], _outer_options(self.config)
        if saved != now:
            diff = {k: (v, now.get(k)) for k, v in saved.items() if now.get(k) != v}
            raise ConfigError(f"this local-steps state was saved with other options "
                              f"(saved, now): {diff}; resume with the saved options")
        check_place({k: state[k] for k in ("world_size", "rank") if k in state},
                    {"world_size": self.world, "rank": self._replica()}, "local-steps state")
        if len(state["fragments"]) != len(self.fragments) or any(
                s["names"] != f.names for s, f in zip(state["fragments"], self.fragments)):
            raise ConfigError("the checkpoint's fragments hold other parameters than this "
                              "model's: resume the same model with the same fragments")
        misfits = [f"{name}: the checkpoint's is {tuple(t.shape)}, this model's "
                   f"{tuple(p.shape)}"
                   for saved_frag, frag in zip(state["fragments"], self.fragments)
                   for key in ("global", "local")
                   for name, t, p in zip(frag.names, saved_frag[key], frag.local)
                   if tuple(t.shape) != tuple(p.shape)]
        if misfits:
            raise ConfigError("the checkpoint's local-steps parameters have other shapes than "
                              f"this model's ({'; '.join(dict.fromkeys(misfits))}): resume the "
                              "same model (the same sizes) it was saved from")
        codec = state.get("codec")
        if codec is None:  # the earlier layout: a list of each fragment's parts' state
            codec = {k: t for f, saved_frag in enumerate(state["fragments"])
                     for p, part in enumerate(saved_frag["codec"])
                     for k, t in named(outer_channel(f, p), part).items()}
        live = self._codec_state()
        check(live, codec, {outer_channel(f.index, p): part.exchange.spec
                            for f in self.fragments for p, part in enumerate(f.parts)},
              "local-steps codec state")
        check_finite(codec, "local-steps codec state", fix=_CODEC_FIX)
        self.step, self.syncs = int(state["step"]), int(state["syncs"])
        self.raw_bytes, self.wire_bytes = int(state["raw_bytes"]), int(state["wire_bytes"])
        for frag, saved_frag in zip(self.fragments, state["fragments"]):
            with torch.no_grad():
                for g, s in zip(frag.global_, saved_frag["global"]):
                    g.copy_(s)
                for p, s in zip(frag.local, saved_frag["local"]):
                    p.copy_(s)
            frag.outer.load_state_dict(saved_frag["outer"])
        for k, t in live.items():
            t.copy_(codec[k])
        for frag, saved_frag in zip(self.fragments, state["fragments"]):
            pending = saved_frag["pending"]
            frag.in_flight = None if pending is None else InFlight(
                pending["started"], pending["merge_at"],
                averaged=[a.clone() for a in pending["averaged"]])


#: How to resume when a local-steps checkpoint's codec state is damaged.
_CODEC_FIX = ("Resume from an earlier checkpoint, or leave the codec state out: before loading, "
              "state['codec'] = outer.state_dict()['codec'] (this run's fresh state: error "
              "feedback from zero, PowerSGD from a new Q).")


def _outer_options(config: Config) -> dict:
    keys = ("sync_every", "outer_codec", "outer_lr", "outer_momentum", "outer_nesterov",
            "fragments", "fragment_delay", "fragment_alpha")
    return {k: getattr(config, k) for k in keys}


def _comm(group):
    return ProcessGroupComm(group)


def local_steps(target, optimizer, group=None, *, compiled_config: Config | None = None,
                compiled_ledger=None, **options) -> LocalSteps:
    """Sync ``target``'s parameters every ``sync_every`` steps of ``optimizer`` (see the module
    docstring). ``target``: a model (compiled by ccfx or not) or the list of stages
    ``ccfx.build_stages`` returned (PP × DP: each stage syncs over its ``dp_group``).
    ``options``: local-step options (``sync_every``, ``outer_codec``, ...), over those the model
    was compiled with. Every replica must call it, in the same order as its other groups.

    ``compiled_config`` / ``compiled_ledger``: for a model compiled by ccfx, the options it
    was compiled with and a function returning its ledger (or None before the first call);
    ``ccfx.local_steps`` looks them up in the backend."""
    from .elastic import split_options

    options, elastic = split_options(options)
    if elastic is not None and isinstance(target, (list, tuple)):
        raise ConfigError("fault_tolerant=True takes a model, one process per replica: a "
                          "replica of several ranks (pipeline stages) is not supported")
    config, ledger, named = _target(target, compiled_config, compiled_ledger)
    if group is None and isinstance(target, (list, tuple)):
        sync = getattr(target[0], "grad_sync", None)
        group = getattr(sync, "dp_group", None)
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError("local steps over pipeline stages need the stages' data-parallel "
                              "group: build them with ccfx.build_stages(..., dp_group=...)")
    if options:
        unknown = sorted(set(options) - set(Config.keys()))
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; valid: {Config.keys()}")
        config = config.replace(**options)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in named if id(p) not in in_optimizer]
    if missing:
        raise ConfigError(f"parameters {missing[:3]}{' ...' if len(missing) > 3 else ''} are not "
                          "in the optimizer: local steps sync what the optimizer trains; give "
                          "it every parameter that requires grad")
    outer = LocalSteps(named, optimizer, config, group, ledger, elastic)
    ctx = getattr(target, "dynamo_ctx", None)
    if ctx is not None:  # the backend checks, when it compiles, that something syncs the model
        ctx._ccfx_local_steps = weakref.ref(outer)
    return outer


def _target(target, compiled_config: Config | None, compiled_ledger):
    """(config, ledger, named parameters) of a model or a rank's stages; the ledger may be a
    function returning it (a compiled model's backend exists only after its first call)."""
    if isinstance(target, (list, tuple)):
        if not target or not hasattr(target[0], "submod"):
            raise ConfigError("ccfx.local_steps takes a model or the list ccfx.build_stages "
                              f"returned, got {type(target).__name__}")
        sync = getattr(target[0], "grad_sync", None)
        if sync is None:
            raise ConfigError("these stages were not built by ccfx.build_stages()")
        config, ledger = sync.config, sync.ledger
        seen, named = set(), []
        for st in target:
            for n, p in st.submod.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    named.append((f"stage{st.stage_index}.{n}", p))
        return config, ledger, named
    if not isinstance(target, torch.nn.Module):
        raise ConfigError(f"ccfx.local_steps takes an nn.Module or a list of stages, got "
                          f"{type(target).__name__}")
    config = compiled_config
    ledger = compiled_ledger if config is not None else None  # the backend's, once it exists
    named = [(n.removeprefix("_orig_mod."), p) for n, p in target.named_parameters()
             if p.requires_grad]
    return config or Config(), ledger, named
