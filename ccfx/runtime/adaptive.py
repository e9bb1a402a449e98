"""Compression that adapts over training: each DDP bucket switches between a light and a heavy
codec, light in the "critical regimes" where its gradient changes fast (ACCORDION, Agarwal et
al., MLSys 2021; per bucket, as CGX's layer-wise adaptation, Markov et al., ASPLOS'23).

    state, hook = ccfx.ddp_comm_hook("adaptive:light=int8,heavy=topk:ratio=0.01,ef,eta=0.5,every=50")
    ddp_model.register_comm_hook(state, hook)
    print(ccfx.ledger_of(ddp_model))          # bytes per bucket, and each switch with its step

The rule (ACCORDION's). Steps are cut into detection intervals of ``every`` steps (an interval
ends at step t when ``(t + 1) % every == 0``). Over an interval each bucket sums its *averaged*
gradient; at the interval's end the norm of the mean, ``n_k``, is compared with the previous
interval's: ``|n_k - n_{k-1}| / n_{k-1} >= eta`` is a critical regime and the next interval uses
the light codec, otherwise the heavy one. Training starts light. One departure from ACCORDION:
the norms compared are of what the codecs delivered, and a heavy codec delivers a smaller
gradient (top-k keeps a few per cent of it), so the interval after a switch is not compared with
the one before: it only becomes the reference, and the new codec holds for at least two
intervals (the same holds for the first interval). Without this, a switch to the heavy codec
reads as a critical regime at once and the bucket flips back and forth.

Agreement without a message. The averaged gradient the hook returns is the same bits on every
rank (:mod:`ccfx.wire.exchange`: the gather codecs sum the decoded payloads in rank order on
every rank, an all-reduce hands every rank the same sum, PowerSGD's P and Q averages are
all-reduced and the product is computed from them alike), so are its sum over an interval and
the step count. The norm is summed in a fixed pairwise order of elementwise fp64 adds (the fp32
squares are exact in fp64), which no thread count or vector width changes: every rank computes
the same norm, the same decision, and switches at the same step, without exchanging a byte. The
error-feedback residual is each rank's own, so it takes no part in the rule (it would need a
collective per interval).

Error feedback across a switch. The residual is never dropped: what the new codec's error
feedback can hold is carried over (both flat codecs with ``ef``: all of it; PowerSGD with ``ef``
holds its matrices' parts), the rest (a codec without error feedback, PowerSGD's raw tensors) is
added to the bucket's next gradient, which sends it once through the new codec. The old codec's
residual is zeroed; its other state (PowerSGD's Q, counters) waits for the next switch back.

State and checkpoints. Each bucket keeps both codecs' state, the interval's gradient sum
(``acc``, fp32, the bucket's size), with a flush buffer of that size where a switch can leave one,
and on the CPU its mode, the last interval's norm and the interval's step count. They are named
as the hook's state is (``ddp.bucket0.light_residual``, ``ddp.bucket0.heavy_q0000``,
``ddp.bucket0.acc``, ``ddp.bucket0.mode``, ...), so ``state_dict()`` / ``load_state_dict()``
resume with each bucket's codec and norm history. Eager only: the payload's shape changes at a
switch, which a compiled graph's static shapes cannot follow.
"""

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .. import codecs
from ..config import Config
from ..errors import CcfxWarning, ConfigError
from ..wire.exchange import BucketLayout, Exchange, PowerSGDExchange, exchange_for
from ..wire.link import resolve_collective
from .comm_hook import CommHookState, Hook, codec_hook

PREFIX = "adaptive:"
KEYS = ("light", "heavy", "eta", "every")
LIGHT, HEAVY = 0, 1
NAMES = ("light", "heavy")
_FORM = "adaptive:light=<codec>,heavy=<codec>[,eta=0.5][,every=50]"


@dataclass(frozen=True)
class AdaptiveSpec:
    """The two codecs, the threshold ``eta`` on the relative norm change and the detection
    interval ``every`` (steps)."""

    light: str
    heavy: str
    eta: float = 0.5
    every: int = 50

    @property
    def spec(self) -> str:
        return (f"{PREFIX}light={self.light},heavy={self.heavy},eta={self.eta!r},"
                f"every={self.every}")


def is_adaptive(spec) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(PREFIX)


def _fields(text: str) -> dict[str, str]:
    """``key -> value`` of an adaptive spec; a token without a known key continues the codec
    before it (``heavy=topk:ratio=0.01,ef``)."""
    fields: dict[str, str] = {}
    current = None
    for token in text.strip()[len(PREFIX):].split(","):
        key, eq, value = token.partition("=")
        key = key.strip().lower()
        if eq and key in KEYS:
            if key in fields:
                raise ConfigError(f"{text!r}: {key}= is given twice; write {_FORM}")
            fields[key], current = value.strip(), key
        elif current in ("light", "heavy") and token.strip():
            fields[current] += "," + token.strip()
        else:
            raise ConfigError(f"{text!r}: cannot read {token.strip()!r}; write {_FORM}, e.g. "
                              "adaptive:light=int8,heavy=topk:ratio=0.01,ef")
    return fields


def _codec(text: str, role: str, value: str | None) -> str:
    if not value:
        raise ConfigError(f"{text!r}: no {role}= codec; write {_FORM}, e.g. "
                          "adaptive:light=int8,heavy=topk:ratio=0.01,ef")
    if is_adaptive(value):
        raise ConfigError(f"{text!r}: {role}={value!r} is adaptive itself; give a codec")
    try:
        return codecs.canonical(value)
    except ConfigError as e:
        raise ConfigError(f"{text!r}: {role}={value!r}: {e}") from None


def _number(text: str, fields: dict[str, str], key: str, kind: type, default):
    if key not in fields:
        return default
    try:
        value = kind(fields[key])
    except ValueError:
        value = None
    if value is None or not value > 0 or not math.isfinite(value):
        what = "a positive number (ACCORDION's 0.5)" if kind is float else "a step count >= 1"
        raise ConfigError(f"{text!r}: {key}={fields[key]!r}: give {what}")
    return value


def parse(text: str) -> AdaptiveSpec:
    """The :class:`AdaptiveSpec` of ``text``; a :class:`~ccfx.ConfigError` naming what to
    write when it is not one."""
    if not is_adaptive(text):
        raise ConfigError(f"{text!r} is not an adaptive spec; write {_FORM}")
    fields = _fields(text)
    light = _codec(text, "light", fields.get("light"))
    heavy = _codec(text, "heavy", fields.get("heavy"))
    if light == heavy:
        raise ConfigError(f"{text!r}: light and heavy are both {light!r}, nothing to switch; "
                          f"use ccfx.ddp_comm_hook({light!r})")
    return AdaptiveSpec(light, heavy, _number(text, fields, "eta", float, 0.5),
                        _number(text, fields, "every", int, 50))


def _warn_if_swapped(setting: AdaptiveSpec) -> None:
    """A light codec that sends fewer bytes than the heavy one (on a 1024 x 1024 fp32
    tensor) runs as asked, with a warning: critical regimes then get the stronger compression."""
    probe = BucketLayout(((1024, 1024),), torch.float32)
    light, heavy = (exchange_for(probe, s).wire_bytes() for s in (setting.light, setting.heavy))
    if light < heavy:
        warnings.warn(
            f"{setting.spec}: the light codec sends fewer bytes ({light} B per 1024x1024 fp32 "
            f"tensor) than the heavy one ({heavy} B): critical regimes get the stronger "
            "compression. Swap light= and heavy= unless that is meant.", CcfxWarning,
            stacklevel=5)  # the caller of ccfx.ddp_comm_hook


def relative_change(previous: float, norm: float) -> float:
    """ACCORDION's ``|n_k - n_{k-1}| / n_{k-1}``; infinite for a norm leaving zero."""
    if previous == 0.0:
        return 0.0 if norm == 0.0 else math.inf
    return abs(norm - previous) / previous


def decide(previous: float | None, norm: float, eta: float, mode: int) -> int:
    """The next interval's codec: :data:`LIGHT` in a critical regime (relative change >=
    ``eta``), else :data:`HEAVY`; ``mode`` (the current one) when there is no reference norm
    (``previous`` None: the first interval, or the first after a switch)."""
    if previous is None:
        return mode
    return LIGHT if relative_change(previous, norm) >= eta else HEAVY


def fixed_order_norm(x: torch.Tensor) -> float:
    """The 2-norm of ``x`` summed in one fixed pairwise order of elementwise fp64 adds: the
    same bits for the same ``x`` on any thread count, vector width or device (a library
    reduction's order depends on them)."""
    v = x.detach().reshape(-1).double().square()
    size = 1 << max(v.numel() - 1, 0).bit_length()
    v = torch.nn.functional.pad(v, (0, size - v.numel()))
    while v.numel() > 1:
        half = v.numel() // 2
        v = v[:half] + v[half:]
    return math.sqrt(float(v.sum()))


# -- error feedback across a switch -------------------------------------------------------------


def _offsets(layout: BucketLayout) -> list[int]:
    out = [0]
    for n in layout.numels:
        out.append(out[-1] + n)
    return out


def take_residual(ex: Exchange, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The codec's error-feedback residual as one flat fp32 vector of the bucket (zeros where
    it keeps none), zeroing it; None for a codec without error feedback."""
    if isinstance(ex, PowerSGDExchange):
        if not ex.error_feedback:
            return None
        out = torch.zeros(ex.layout.numel, dtype=torch.float32,
                          device=state[f"residual{ex.mats[0]:04d}"].device) if ex.mats else None
        at = _offsets(ex.layout)
        for i in ex.mats:
            part = state[f"residual{i:04d}"]
            out[at[i]:at[i + 1]] = part.reshape(-1).float()
            part.zero_()
        return out
    if "residual" not in state:
        return None
    out = state["residual"].reshape(-1).float().clone()
    state["residual"].zero_()
    return out


def give_residual(ex: Exchange, state: dict[str, torch.Tensor],
                  residual: torch.Tensor) -> torch.Tensor | None:
    """Put what the codec's error feedback can hold of ``residual`` into its state; return
    the rest (None when it held all)."""
    if isinstance(ex, PowerSGDExchange) and ex.error_feedback:
        rest = residual.clone()
        at = _offsets(ex.layout)
        for i in ex.mats:
            mine = state[f"residual{i:04d}"]
            mine.copy_(residual[at[i]:at[i + 1]].view(mine.shape))
            rest[at[i]:at[i + 1]] = 0
        return rest if ex.raw else None
    if not isinstance(ex, PowerSGDExchange) and "residual" in state:
        state["residual"].copy_(residual.view(state["residual"].shape))
        return None
    return residual


def _holds_residual(ex: Exchange) -> bool:
    return isinstance(ex, PowerSGDExchange) and ex.error_feedback or (
        not isinstance(ex, PowerSGDExchange) and "residual" in ex.state_layout())


def _holds_all(ex: Exchange) -> bool:
    return not isinstance(ex, PowerSGDExchange) and "residual" in ex.state_layout()


# -- the bucket's exchange ----------------------------------------------------------------------


class AdaptiveExchange(Exchange):
    """A bucket's light and heavy exchanges, run eagerly, one per step as the bucket's mode
    says; it sums the averaged gradient and decides at each interval's end (module docstring).

    Its state is both codecs' (prefixed ``light_`` / ``heavy_``) and the rule's: ``acc`` (the
    interval's gradient sum), ``mode``, ``norm`` (the previous interval's; -1: none, at the
    start and after a switch), ``count`` (steps summed), and ``flush`` / ``pending`` where a
    switch can leave a residual for the next step."""

    def __init__(self, layout: BucketLayout, setting: AdaptiveSpec,
                 pair: tuple[Exchange, Exchange], step_of: Callable[[], int],
                 on_switch: Callable[[int, int, int, float], None]):
        self.layout, self.setting, self.pair = layout, setting, pair
        self._step_of, self._on_switch = step_of, on_switch
        self._state: dict[str, torch.Tensor] = {}  # init_state's, read by the plan and errors
        self._ran: Exchange = pair[LIGHT]
        self.flushes = any(_holds_residual(a) and not _holds_all(b)
                           for a, b in (pair, pair[::-1]))

    @property
    def _mode(self) -> int:
        return int(self._state["mode"]) if self._state else LIGHT

    @property
    def spec(self) -> str:  # type: ignore[override]
        return self.pair[self._mode].spec

    @property
    def collective(self) -> str:  # type: ignore[override]
        return self.pair[self._mode].collective

    @property
    def phases(self):
        raise ConfigError("an adaptive bucket runs eagerly (the DDP comm hook): its payload's "
                          "shape changes at a switch, which a traced graph cannot follow")

    def wire_bytes(self) -> int:
        return self.pair[self._mode].wire_bytes()

    def sent_bytes(self) -> int:
        return self._ran.sent_bytes()

    def state_layout(self):
        n = self.layout.numel
        out = {f"{NAMES[m]}_{k}": v for m in (LIGHT, HEAVY)
               for k, v in self.pair[m].state_layout().items()}
        out.update(acc=((n,), torch.float32), mode=((), torch.int64),
                   norm=((), torch.float64), count=((), torch.int64))
        if self.flushes:
            out.update(flush=((n,), torch.float32), pending=((), torch.int64))
        return out

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        out = {f"{NAMES[m]}_{k}": t for m in (LIGHT, HEAVY)
               for k, t in self.pair[m].init_state(device).items()}
        out["acc"] = torch.zeros(self.layout.numel, dtype=torch.float32, device=device)
        if self.flushes:
            out["flush"] = torch.zeros(self.layout.numel, dtype=torch.float32, device=device)
            out["pending"] = torch.zeros((), dtype=torch.int64)
        # on the CPU: read every step without waiting for a device
        out["mode"] = torch.full((), LIGHT, dtype=torch.int64)
        out["norm"] = torch.full((), -1.0, dtype=torch.float64)
        out["count"] = torch.zeros((), dtype=torch.int64)
        self._state = out
        return out

    @staticmethod
    def own(state: dict[str, torch.Tensor], mode: int) -> dict[str, torch.Tensor]:
        """One codec's state tensors under their own names (the same tensors)."""
        prefix = NAMES[mode] + "_"
        return {k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix)}

    def run(self, grads: Sequence[torch.Tensor], state: dict[str, torch.Tensor], comm):
        step = self._step_of()
        mode = int(state["mode"])
        if self.flushes and int(state["pending"]):
            flat = self.layout.flat(grads) + state["flush"].to(self.layout.dtype)
            grads = self.layout.unflat(flat)
            state["flush"].zero_()
            state["pending"].zero_()
        self._ran = self.pair[mode]
        averaged = self._ran.run(grads, self.own(state, mode), comm)
        self._observe(averaged, state, step, mode)
        return averaged

    def _observe(self, averaged, state, step: int, mode: int) -> None:
        """Sum the averaged gradient; at an interval's end, decide the next interval's codec."""
        for part, grad in zip(state["acc"].split(self.layout.numels), averaged):
            part.add_(grad.reshape(-1))  # in place: no bucket-sized copy per step
        state["count"].add_(1)
        if (step + 1) % self.setting.every:
            return
        norm = fixed_order_norm(state["acc"]) / int(state["count"])
        saved = float(state["norm"])
        previous = None if saved < 0 else saved
        new = decide(previous, norm, self.setting.eta, mode)
        state["norm"].fill_(norm if new == mode else -1.0)  # a switch: no reference yet
        state["acc"].zero_()
        state["count"].zero_()
        if new != mode:
            self._switch(state, mode, new)
            self._on_switch(step + 1, mode, new, relative_change(previous, norm))

    def _switch(self, state, old: int, new: int) -> None:
        """Carry the residual into the new codec; what it cannot hold waits in ``flush``."""
        state["mode"].fill_(new)
        residual = take_residual(self.pair[old], self.own(state, old))
        if residual is None:
            return
        rest = give_residual(self.pair[new], self.own(state, new), residual)
        if rest is not None:
            state["flush"].add_(rest)
            state["pending"].fill_(1)


# -- the hook's state ---------------------------------------------------------------------------


class AdaptiveHookState(CommHookState):
    """:class:`~ccfx.runtime.comm_hook.CommHookState` whose buckets switch codecs
    (:class:`AdaptiveExchange`); ``spec`` is the canonical adaptive spec, ``setting`` its
    parts. Each switch is a row of ``ledger.switches`` (``ccfx.ledger_of(ddp_model)``)."""

    def __init__(self, spec: str, process_group=None, collective: str = "all_gather", *,
                 collective_timeout_s: float = Config.collective_timeout_s):
        setting = parse(spec)
        super().__init__(setting.light, process_group, collective,
                         collective_timeout_s=collective_timeout_s)
        _warn_if_swapped(setting)
        self.setting = setting
        self.spec = setting.spec

    def _exchange_for(self, index: int, layout: BucketLayout) -> Exchange:
        world = dist.get_world_size(self.process_group)
        pair = tuple(exchange_for(layout, s, resolve_collective(
            self.collective, s, layout.numel, layout.dtype, world))
            for s in (self.setting.light, self.setting.heavy))
        return AdaptiveExchange(layout, self.setting, pair, lambda: self.steps,
                                partial(self._switched, index))

    def _switched(self, index: int, step: int, old: int, new: int, change: float) -> None:
        sign = ">=" if new == LIGHT else "<"
        why = f"gradient-norm change {change:.3g} {sign} eta {self.setting.eta:g}"
        self.ledger.record_switch(0, index, step, self._codec(old), self._codec(new), why)

    def _codec(self, mode: int) -> str:
        return (self.setting.light, self.setting.heavy)[mode]

    def _same_codec(self, saved: str) -> bool:
        return is_adaptive(saved) and parse(saved).spec == self.spec

    def plan_spec(self) -> str:
        """The heavy codec: the one outside critical regimes (each bucket's row names its own
        current codec)."""
        return self.setting.heavy

    def modes(self) -> dict[int, str]:
        """Each live bucket's current codec."""
        return {i: self._codec(int(b.tensors["mode"])) for i, b in sorted(self.buckets.items())}


def adaptive_comm_hook(spec: str, process_group=None, collective: str = "all_gather", *,
                       collective_timeout_s: float = Config.collective_timeout_s,
                       ) -> tuple[AdaptiveHookState, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)`` with an adaptive
    spec (``ccfx.ddp_comm_hook`` hands such a spec here). The hook is the comm hook's own
    (:func:`~ccfx.runtime.comm_hook.codec_hook`): the state's buckets do the switching."""
    return (AdaptiveHookState(spec, process_group, collective,
                              collective_timeout_s=collective_timeout_s), codec_hook)
