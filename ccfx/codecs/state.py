"""Codec state: made one way, passed explicitly, named one way.

Stateful codecs (error feedback's ``residual``, PowerSGD's ``q``, a stochastic codec's
``step`` counter) keep their state in tensors that no codec object holds:

* **made** by ``Codec.init_state(shape, dtype, device)``; a gradient bucket's or an outer-sync
  part's by its exchange, ``Exchange.init_state(device)`` (which draws the bucket's PowerSGD
  Q's as ``powerSGD_hook`` does);
* **passed** to every call: ``codec.encode_with(x, state)`` / ``decode_with(enc, state)``, the
  ``ccfx_codecs::encode`` / ``decode`` ops, an exchange's phases, ``WireFormat.encode(x,
  state)``; they update it in place;
* **owned** by the runtime piece that runs the codec, and **named** in every checkpoint

      <channel>.<state-name>

  ``state-name`` is the codec's (``q``, ``residual``, ``step``) or a bucket exchange's
  (``q0003``, ``residual0003``: PowerSGD's, per tensor of the bucket). ``channel`` says where
  the codec runs; the functions below build every one (:func:`key` joins the two):

  ====================================  ===========================================================
  channel                               whose state, and where it is checkpointed
  ====================================  ===========================================================
  ``graph0.edge3.hop1to2.fwd`` (``bwd``)  a cut edge's hop, forward (backward), in the simulation:
                                        ``ccfx.codec_state(compiled).state_dict()``
  ``graph0.edge3.hop1to2.fwd.send``     the same hop on a pipeline rank, sender's (``recv``:
                                        receiver's) state: ``stage.submod.state_dict()``, under
                                        ``ccfx_codec_state.``
  ``graph0.bucket2``                    a data-parallel gradient bucket of the compiled backward:
                                        ``ccfx.codec_state(compiled).state_dict()``
  ``graph0.stage1.bucket0``             PP × DP: a bucket of the rank whose first stage is stage 1:
                                        that stage's ``submod.state_dict()``, under
                                        ``ccfx_codec_state.``
  ``ddp.bucket0``                       the DDP comm hook's bucket 0:
                                        ``hook_state.state_dict()["state"]``
  ``outer.fragment0.part1``             local steps' outer sync, fragment 0's second exchange:
                                        ``outer.state_dict()["codec"]``
  ``fsdp2.blocks.0.reduce_scatter``     FSDP2 module ``blocks.0``'s reduce-scatter (``all_gather``,
                                        HSDP's ``all_reduce``): ``codecs.state_dict()["state"]``
  ====================================  ===========================================================

:class:`CodecState` is the ``nn.Module`` that holds a model's or a stage's channels as buffers
(one submodule per name segment, so its ``state_dict()`` keys are exactly the names above).
Loading a checkpoint whose codec state has other names, shapes or dtypes (another codec, other
options, another model or pipeline split) raises :class:`ccfx.ConfigError` naming each channel
and the option that sets its codec, not torch's ``load_state_dict`` error. Checkpoints saved
before this scheme (``graph0_edge3_hop1to2_fwd_residual``, ``buckets.graph0_bucket2_q0000``,
a stage's ``ccfx_codec_state.edge3_send_fwd_residual`` and ``ccfx_grad_state.bucket0_q0000``,
the comm hook's and local steps' nested dicts) still load: their names are translated.

What the state was made for rides along under ``meta.`` (:meth:`CodecState.set_meta`):
compiled data parallel records ``meta.world_size`` and ``meta.rank`` (error-feedback residuals
and PowerSGD's Q are one rank's own) and each graph's backward count
``meta.graph0.backward_steps`` (what ends ``warmup_steps``: a resumed run goes on compressing
where the saved one was); a pipeline stage's holder records ``meta.stage``,
``meta.num_stages``, ``meta.dp_world_size`` and ``meta.dp_rank`` (its place: the stage and,
under PP × DP, the replica); every holder records each channel's codec spec in
``meta.codecs`` (the JSON of ``{channel: spec}`` as bytes: two codecs can keep state of one
shape, error feedback's residual). The state's names, shapes and dtypes are the tensors
themselves. A checkpoint made for another place (:data:`PLACE`: world size, rank, stage) or
another codec is a :class:`ccfx.ConfigError` saying what differs and what to do
(:func:`check_place`, also what the DDP comm hook's and local steps' ``load_state_dict``
call). A checkpoint saved before ``meta`` existed, or without one of its entries, loads as
before: what it does not record is not checked.

A damaged checkpoint is refused, not loaded: state holding NaN or ±inf (:func:`check_finite`:
ccfx never keeps such state, and it would make the loss NaN from the first step) and a ``meta``
entry that cannot be read (:func:`read_codecs`, :func:`meta_int`: passed over, it would turn
off the checks above) are a :class:`ccfx.ConfigError` naming the channels and the fix (an
earlier checkpoint, or the codec state left out). Every loader checks: :class:`CodecState`,
the DDP comm hook's and local steps' ``load_state_dict``, the framework integrations' files.

A holder whose owner has not compiled yet (:attr:`CodecState.deferred`:
``ccfx.codec_state(compiled)`` before the first call) keeps a loaded checkpoint and checks and
copies each channel's state into the tensors :meth:`CodecState.add` registers, before the
codec's first encode; saved channels no ``add`` claimed are a ConfigError from
:meth:`CodecState.check_unclaimed`, which the backend calls at the second call (every channel
exists once a first forward and backward have run).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from .. import _torch_compat as tc
from ..errors import ConfigError

Tensors = dict[str, torch.Tensor]

#: The attribute a pipeline stage's module holds its :class:`CodecState` under.
STAGE_ATTR = "ccfx_codec_state"

SCHEME = ("<channel>.<state-name>, channel one of graph<g>.edge<e>.hop<a>to<b>.<fwd|bwd>[.<send|"
          "recv>], graph<g>.bucket<b>, graph<g>.stage<s>.bucket<b>, ddp.bucket<b>, "
          "outer.fragment<f>.part<p>, fsdp2.<module>.<kind> (see ccfx.codecs.state)")


# -- names ------------------------------------------------------------------------------------


def edge_channel(graph: int, edge: int, hop: tuple[int, int], direction: str,
                 role: str | None = None) -> str:
    """A cut edge's hop: ``graph0.edge3.hop1to2.fwd``; on a pipeline rank with the side that
    keeps it, ``graph0.edge3.hop1to2.fwd.send`` (``recv``)."""
    if direction not in ("fwd", "bwd") or role not in (None, "send", "recv"):
        raise ValueError(f"direction {direction!r}, role {role!r}")
    name = f"graph{graph}.edge{edge}.hop{hop[0]}to{hop[1]}.{direction}"
    return name if role is None else f"{name}.{role}"


def bucket_channel(graph: int, bucket: int, stage: int | None = None) -> str:
    """A gradient bucket: ``graph0.bucket2`` (compiled data parallel), ``graph0.stage1.bucket0``
    (PP × DP, the buckets of the rank whose first stage is ``stage``)."""
    return f"graph{graph}.bucket{bucket}" if stage is None else \
        f"graph{graph}.stage{stage}.bucket{bucket}"


def ddp_channel(bucket: int) -> str:
    """The DDP comm hook's bucket: ``ddp.bucket0``."""
    return f"ddp.bucket{bucket}"


def fsdp2_channel(module: str, kind: str) -> str:
    """An FSDP2 module's collective: ``fsdp2.blocks.0.reduce_scatter`` (``root``: the model's
    own FSDP module; kind ``all_gather``, ``reduce_scatter`` or HSDP's ``all_reduce``)."""
    return f"fsdp2.{module}.{kind}"


def outer_channel(fragment: int, part: int) -> str:
    """Local steps' outer sync, one exchange of a fragment: ``outer.fragment0.part1``."""
    return f"outer.fragment{fragment}.part{part}"


def key(channel: str, name: str) -> str:
    """The checkpoint name of state tensor ``name`` of ``channel``: ``<channel>.<name>``."""
    return f"{channel}.{name}"


def named(channel: str, tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """``tensors`` under their checkpoint names."""
    return {key(channel, k): t for k, t in tensors.items()}


def split_key(name: str) -> tuple[str, str]:
    """``(channel, state-name)`` of a checkpoint name."""
    channel, _, state = name.rpartition(".")
    return channel, state


def option_of(channel: str) -> str:
    """The option that sets the codec of ``channel`` (for error messages)."""
    if channel.startswith("ddp."):
        return "the hook's codec (ccfx.ddp_comm_hook(spec))"
    if channel.startswith("outer."):
        return "outer_codec"
    if channel.startswith("fsdp2."):
        return f"register_codec's codec for {channel.rpartition('.')[2]}"
    if ".collective" in channel:
        return "collective_codec / collective_overrides"
    if ".bucket" in channel:
        return "gradient_codec"
    if ".bwd" in channel:
        return "activation_grad_codec"
    return "activation_codec"


# -- checking a checkpoint against the live state ---------------------------------------------


def _describe(t) -> str:
    shape, dtype = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
    return f"{tuple(shape)} {str(dtype).replace('torch.', '')}"


def check(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor],
          specs: Mapping[str, str] | None = None, what: str = "codec state",
          strict: bool = True) -> None:
    """Raise :class:`ccfx.ConfigError` unless ``got`` (a checkpoint's state, by name) has the
    names, shapes and dtypes of ``want`` (the live state); ``specs``: each live channel's codec.
    With ``strict=False`` only the names both have must agree."""
    specs = specs or {}
    by_channel: dict[str, list[str]] = {}
    for k in sorted(set(want) | set(got)):
        channel, name = split_key(k)
        w, g = want.get(k), got.get(k)
        if w is None and strict:
            by_channel.setdefault(channel, []).append(f"the checkpoint has {name} "
                                                      f"{_describe(g)}, this model none")
        elif g is None and strict:
            by_channel.setdefault(channel, []).append(f"this model needs {name} {_describe(w)}, "
                                                      "the checkpoint has none")
        elif w is not None and g is not None and (
                tuple(w.shape) != tuple(g.shape) or w.dtype != g.dtype):
            by_channel.setdefault(channel, []).append(
                f"{name}: the checkpoint's is {_describe(g)}, this model needs {_describe(w)}")
    if not by_channel:
        return
    lines = []
    for channel, problems in by_channel.items():
        spec = specs.get(channel)
        codec = f", {option_of(channel)}={spec!r}" if spec else f", set by {option_of(channel)}"
        lines.append(f"  {channel}{codec}: {'; '.join(problems)}")
    options = sorted({option_of(split_key(k)[0]) for k in set(want) | set(got)})
    hint = ""
    if not want:
        hint = (" This model has no codec state yet: ccfx makes it when it compiles the training "
                "graph (run one forward with grad enabled first) or builds the stages.")
    raise ConfigError(
        f"the checkpoint's {what} does not fit this model's (names are {SCHEME}):\n"
        + "\n".join(lines)
        + f"\nResume with the options it was saved with ({', '.join(options)}, bucket_mb, "
        "compress_min_numel), the same model, stages and world size." + hint)


#: What per-rank codec state was made for, compared when a checkpoint loads: the
#: data-parallel world and rank (compiled data parallel, the DDP comm hook, local steps' replicas)
#: and a pipeline stage's place (its index, the plan's stage count, its replica under PP × DP).
PLACE = ("world_size", "rank", "num_stages", "stage", "dp_world_size", "dp_rank")


def check_place(saved: Mapping[str, int], live: Mapping[str, int],
                what: str = "codec state") -> None:
    """Raise :class:`ccfx.ConfigError` where ``saved`` (what a checkpoint records of
    :data:`PLACE`) and ``live`` (this run's) differ, or where ``saved`` holds no integer
    (:func:`meta_int`); what either does not record (a checkpoint saved before ccfx recorded
    it) is not checked."""
    saved = {k: meta_int(k, v, what=what) for k, v in saved.items() if k in PLACE}
    differ = [f"{k}: the checkpoint's is {saved[k]}, this run's is {int(live[k])}"
              for k in PLACE if k in saved and k in live and saved[k] != int(live[k])]
    if not differ:
        return
    stages = any(k in ("stage", "num_stages", "dp_world_size", "dp_rank") for k in saved)
    own = "one pipeline stage's, of one replica" if stages else "each rank's own"
    raise ConfigError(
        f"the checkpoint's {what} was made for another place in the job: " + "; ".join(differ)
        + f". Codec state (error-feedback residuals, PowerSGD's Q, counters) is {own}: resume "
        "on the same number of ranks with the same stages, each rank loading the state it "
        "saved; to change the world size or the stages, load the parameters and optimizer "
        f"only and leave the {what} out (the codecs start afresh: error feedback from zero).")


# -- refusing a damaged checkpoint ------------------------------------------------------------

#: The fix for a damaged checkpoint, when its caller names no better one.
FIX = ("Resume from an earlier checkpoint, or leave the codec state out (the codecs start "
       "afresh: error feedback from zero, PowerSGD from a new Q).")


def _of(what: str, where: str | None) -> str:
    return f"{where}: the checkpoint's {what}" if where else f"the checkpoint's {what}"


def check_finite(got: Mapping[str, torch.Tensor], what: str = "codec state",
                 where: str | None = None, fix: str = FIX) -> None:
    """Raise :class:`ccfx.ConfigError` naming each channel of ``got`` (a checkpoint's state, by
    name) that holds NaN or ±inf. ccfx never keeps such state (error feedback and PowerSGD
    reset non-finite entries as they run), so the checkpoint is damaged, and loading it would
    add NaN to every gradient or activation from the first step. ``where``: the file."""
    bad: dict[str, list[str]] = {}
    for k, t in sorted(got.items()):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or not (
                t.is_floating_point() or t.is_complex()):
            continue
        if _all_finite(t):
            continue
        finite = torch.isfinite(t)
        nan = int(torch.isnan(t).sum())
        inf = t.numel() - int(finite.sum()) - nan
        channel, name = split_key(k)
        bad.setdefault(channel, []).append(f"{name} holds {nan} NaN and {inf} ±inf of "
                                           f"{t.numel()} values")
    if not bad:
        return
    lines = "\n".join(f"  {c} ({option_of(c)}): {'; '.join(p)}" for c, p in bad.items())
    raise ConfigError(
        f"{_of(what, where)} holds NaN or ±inf, which ccfx never keeps (the checkpoint is "
        "damaged: loaded, it would make the loss NaN from the first step):\n" + lines + "\n"
        + fix)


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or ±inf in ``t``: one pass, no tensor of its size (a NaN propagates to both ends
    of ``aminmax``, an inf is one of them)."""
    if t.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
    except (RuntimeError, NotImplementedError):  # a dtype without aminmax (float8)
        return bool(torch.isfinite(t.float()).all())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _unreadable(what: str, entry: str, why: str, channels, where: str | None,
                fix: str) -> ConfigError:
    of = f" (it describes the state of {', '.join(channels)})" if channels else ""
    return ConfigError(
        f"{_of(what, where)} has an unreadable {entry}{of}: {why}. It records what the state "
        "was made for, and ccfx does not load codec state it cannot check (the checkpoint is "
        "damaged, or not written by ccfx). " + fix)


def meta_int(name: str, value, channels=(), what: str = "codec state",
             where: str | None = None, fix: str = FIX) -> int:
    """``meta.<name>`` of a checkpoint (an int64 scalar, or an int) as an int;
    :class:`ccfx.ConfigError` naming it and ``channels`` when it is anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        why = f"a {type(value).__name__}, not an integer"
    elif isinstance(value, int):
        return value
    elif value.numel() != 1 or value.is_floating_point() or value.is_complex() \
            or value.dtype == torch.bool:
        why = f"a {_describe(value)} tensor, not an integer scalar"
    else:
        return int(value)
    raise _unreadable(what, f"meta.{name}", why, channels, where, fix)


def read_codecs(saved, channels=(), what: str = "codec state", where: str | None = None,
                fix: str = FIX) -> dict[str, str]:
    """A checkpoint's ``meta.codecs`` (the JSON bytes of ``{channel: spec}``) read;
    :class:`ccfx.ConfigError` naming ``channels`` (the checkpoint's) when it cannot be: passed
    over, it would silently turn off the check that refuses another codec's state."""
    try:
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8 or saved.dim() != 1:
            got = _describe(saved) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise TypeError(f"a {got}, not the 1-D uint8 bytes of a JSON object")
        theirs = json.loads(bytes(saved.tolist()).decode())
        if not isinstance(theirs, dict) or not all(
                isinstance(c, str) and isinstance(s, str) for c, s in theirs.items()):
            raise TypeError("JSON, but not an object of channel -> codec spec")
    except (ValueError, TypeError) as e:  # json's and UTF-8's errors are ValueErrors
        raise _unreadable(what, "meta.codecs", str(e), channels, where, fix) from None
    return theirs


# -- the holder -------------------------------------------------------------------------------


class CodecState(torch.nn.Module):
    """Codec state tensors as buffers named ``<channel>.<state-name>`` (see the module
    docstring): ``ccfx.codec_state(compiled)``, and a pipeline stage's ``ccfx_codec_state``.

    ``add(channel, spec, tensors)`` registers a channel's tensors (the same objects, which the
    runtime passes to the codec); ``channel(name)`` gives them back. Loading a ``state_dict``
    checks the names, shapes and dtypes first (:func:`check`) and translates names of the
    earlier schemes."""

    def __init__(self):
        super().__init__()
        #: channel → the codec spec it runs
        self._specs: dict[str, str] = {}
        self._tensors: dict[str, Tensors] = {}
        #: an earlier scheme's prefix of a channel's names → the channel (relative to the
        #: module whose state_dict holds them: this one, or the stage module it is attached to)
        self._legacy: dict[str, str] = {}
        self._where = ""  # this module's path inside that module ("ccfx_codec_state.")
        #: meta.<name> → its int64 scalar (see set_meta)
        self._meta: dict[str, torch.Tensor] = {}
        #: meta.codecs (see _set_codecs), None until a channel is added
        self._codecs: torch.Tensor | None = None
        #: True until the owner compiles (``ccfx.codec_state(compiled)`` before the first
        #: call): a ``load_state_dict`` then keeps the checkpoint's state in ``_pending`` and
        #: applies it channel by channel as :meth:`add` registers them (see :meth:`unclaimed`).
        self.deferred = False
        self._pending: Tensors = {}  # a deferred load's channel tensors, by checkpoint name
        self._pending_place: dict[str, int] = {}  # its meta entries of PLACE
        self._pending_codecs: dict[str, str] = {}  # its meta.codecs
        self._pending_strict = True
        self._deferred_load = False  # a deferred load happened; its channels are being claimed
        self._strict = True  # the strict of the load_state_dict running
        self._hook = self.register_load_state_dict_pre_hook(self._before_load)

    # -- channels ---------------------------------------------------------------------------

    def add(self, channel: str, spec: str, tensors: Mapping[str, torch.Tensor],
            legacy: str | None = None) -> Tensors:
        """Register ``tensors`` as ``channel``'s state (codec ``spec``); returns them.
        ``legacy``: the prefix of these tensors' names in checkpoints of the earlier scheme.
        A channel added again (a graph compiled anew) replaces its tensors."""
        module: torch.nn.Module = self
        for segment in channel.split("."):
            child = module._modules.get(segment)
            if child is None:
                child = torch.nn.Module()
                module.add_module(segment, child)
            module = child
        if self._deferred_load and channel not in self._tensors:
            self._apply_pending(channel, spec, tensors, legacy)
        for name in self._tensors.get(channel, {}):
            module._buffers.pop(name, None)
        for name, t in tensors.items():
            module.register_buffer(name, t)
        self._specs[channel] = str(spec)
        self._tensors[channel] = dict(tensors)
        if legacy is not None:
            self._legacy[legacy] = channel
        self._set_codecs()
        return dict(tensors)

    def channel(self, channel: str) -> Tensors | None:
        """The state tensors of ``channel`` (None when it has none registered)."""
        return self._tensors.get(channel)

    def channels(self) -> dict[str, str]:
        """Every channel with its codec spec."""
        return dict(self._specs)

    def attach(self, owner: torch.nn.Module, name: str = STAGE_ATTR) -> None:
        """Make this a submodule of ``owner`` (a pipeline stage's module): its names are then
        ``name.<channel>.<state-name>`` in ``owner.state_dict()``, checked when ``owner``
        loads one."""
        owner.add_module(name, self)
        self._where = name + "."
        self._hook.remove()
        self._hook = owner.register_load_state_dict_pre_hook(self._before_load)

    # -- what the state was made for -------------------------------------------------------

    def set_meta(self, name: str, value: int) -> torch.Tensor:
        """Record ``meta.<name>`` (an int64 scalar buffer, in the state_dict); returns it (a
        counter is updated in place)."""
        if name in self._pending_place:  # a deferred load's place, checked as it is set
            check_place({name: self._pending_place.pop(name)}, {name: int(value)})
        module = self._meta_module(name.split("."))
        leaf = name.split(".")[-1]
        t = module._buffers.get(leaf)
        if t is None:
            t = torch.zeros((), dtype=torch.int64)
            module.register_buffer(leaf, t)
        t.fill_(int(value))
        self._meta[name] = t
        return t

    def get_meta(self, name: str) -> torch.Tensor | None:
        return self._meta.get(name)

    def _check_meta(self, got: Mapping[str, int]) -> None:
        """A checkpoint made for another world size, rank or stage (per-rank state) is
        refused."""
        check_place({k: v for k, v in got.items() if k in PLACE},
                    {k: int(t) for k, t in self._meta.items() if k in PLACE})

    def _fix(self) -> str:
        """How to resume when this holder's checkpoint is damaged."""
        drop = (f"load the stage's state_dict without its '{self._where}' entries, with "
                "strict=False" if self._where else
                "do not load it: ccfx.codec_state(compiled).load_state_dict is optional")
        return (f"Resume from an earlier checkpoint, or leave the codec state out ({drop}; the "
                "codecs start afresh: error feedback from zero, PowerSGD from a new Q).")

    def _read_meta(self, meta: Mapping[str, object], got: Mapping[str, torch.Tensor]):
        """A checkpoint's ``meta`` entries read: (the ints by name, ``meta.codecs`` or None);
        :class:`ccfx.ConfigError` naming the checkpoint's channels when one cannot be read."""
        channels = sorted({split_key(k)[0] for k in got})
        codecs_ = meta.get("codecs")
        ints = {k: meta_int(k, v, channels, fix=self._fix())
                for k, v in meta.items() if k != "codecs"}
        theirs = None if codecs_ is None else read_codecs(codecs_, channels, fix=self._fix())
        return ints, theirs

    def _set_codecs(self) -> None:
        """``meta.codecs``: every channel's codec spec, as the bytes of their JSON."""
        text = json.dumps(self._specs, sort_keys=True).encode()
        with tc.unset_fake_temporarily():  # a backward compiles inside a fake mode
            t = torch.tensor(list(text), dtype=torch.uint8)
        self._meta_module(["codecs"]).register_buffer("codecs", t)
        self._codecs = t

    def _meta_module(self, path: list[str]) -> torch.nn.Module:
        """The submodule holding ``meta.<path>`` (made as needed)."""
        module: torch.nn.Module = self
        for segment in ("meta", *path[:-1]):
            child = module._modules.get(segment)
            if child is None:
                child = torch.nn.Module()
                module.add_module(segment, child)
            module = child
        return module

    # -- loading ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if strict and not state_dict and self._tensors:
            check(self._live(), {}, self._specs)  # names what is missing
        self._strict = strict
        return super().load_state_dict(state_dict, strict, assign)

    def _defer(self, state_dict, at: str) -> None:
        """A load before the owner compiled: keep the checkpoint's channels (taken out of
        ``state_dict``, which torch then finds empty) for :meth:`add` to check and apply;
        meta entries of :data:`PLACE` are checked as :meth:`set_meta` records them, the others
        (a graph's backward count) load now."""
        got = {k[len(at):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(at)}
        meta = {k[len("meta."):]: got.pop(k) for k in list(got) if k.startswith("meta.")}
        ints, theirs = self._read_meta(meta, got)
        check_finite(got, fix=self._fix())
        self._pending_codecs = theirs or {}
        self._pending_place = {}
        for name, value in ints.items():
            if name in PLACE:
                self._pending_place[name] = value
            else:  # registered now; torch loads it like any buffer
                self.set_meta(name, value)
                state_dict[f"{at}meta.{name}"] = meta[name]
        self._pending = {k: t.detach().clone() for k, t in got.items()}
        self._pending_strict = self._strict
        self._deferred_load = True

    def _apply_pending(self, channel: str, spec: str, tensors: Mapping[str, torch.Tensor],
                       legacy: str | None) -> None:
        """Check a deferred load's state of ``channel`` against ``tensors`` (just made, not yet
        used: the codec has not encoded anything) and copy it into them."""
        if legacy is not None:  # a checkpoint of the earlier scheme
            for k in [k for k in self._pending if k.startswith(legacy)]:
                if k[len(legacy):] in tensors:
                    self._pending[key(channel, k[len(legacy):])] = self._pending.pop(k)
        saved = {k: self._pending.pop(k) for k in list(self._pending)
                 if split_key(k)[0] == channel}
        if not saved and not self._pending_strict:
            return
        check(named(channel, tensors), saved, {channel: str(spec)})
        saved_spec = self._pending_codecs.pop(channel, None)
        if saved_spec is not None:
            _refuse_other_codecs({channel: saved_spec}, {channel: str(spec)})
        with torch.no_grad(), tc.unset_fake_temporarily():
            for name, t in tensors.items():
                t.copy_(saved[key(channel, name)])

    @property
    def claiming(self) -> bool:
        """A deferred load's state is being applied (until :meth:`check_unclaimed`)."""
        return self._deferred_load

    def unclaimed(self) -> list[str]:
        """The channels a deferred load kept that no :meth:`add` has claimed yet."""
        return sorted({split_key(k)[0] or k for k in self._pending})  # or an earlier name

    def check_unclaimed(self) -> None:
        """Raise :class:`ccfx.ConfigError` (once) for the channels of a strict deferred load
        this model never made: its state would be silently dropped."""
        channels, strict = self.unclaimed(), self._pending_strict
        lines = "\n".join(f"  {c} ({option_of(c)}={self._pending_codecs.get(c)!r})"
                          for c in channels)
        self._pending, self._pending_codecs, self._pending_place = {}, {}, {}
        self._deferred_load = False
        if not channels or not strict:
            return
        raise ConfigError(
            "the codec state loaded before the first call has channels this model never made "
            f"(names are {SCHEME}):\n{lines}\nResume with the options it was saved with (the "
            "same model, stages, codecs and world size), or load it with strict=False to "
            "drop what this model does not use.")

    def _live(self) -> Tensors:
        return {key(c, k): t for c, ts in self._tensors.items() for k, t in ts.items()}

    def _before_load(self, module, state_dict, prefix, *args) -> None:
        at = prefix + self._where
        if self.deferred and not self._tensors:
            self._defer(state_dict, at)
            return
        self._translate(state_dict, prefix, at)
        got = {k[len(at):]: v for k, v in state_dict.items() if k.startswith(at)}
        meta = {k[len("meta."):]: got.pop(k) for k in list(got) if k.startswith("meta.")}
        ints, theirs = self._read_meta(meta, got)  # unreadable: refused, not passed over
        saved_codecs = meta.pop("codecs", None)
        self._check_meta(ints)
        if got:  # a checkpoint without codec state (parameters only) is torch's business
            check(self._live(), got, self._specs)
        if theirs is not None:  # names, shapes and dtypes fit: the codecs too?
            _refuse_other_codecs(theirs, self._specs)
        check_finite(got, fix=self._fix())
        # this run's record of its codecs stands (the checkpoint's may list fewer channels: a
        # holder saved before its backward compiled); none: nothing to load it into
        state_dict.pop(f"{at}meta.codecs", None)
        if (got or meta or saved_codecs is not None) and self._codecs is not None:
            state_dict[f"{at}meta.codecs"] = self._codecs.clone()
        if got or meta:  # a checkpoint saved before meta existed: keep this run's values
            for name, t in self._meta.items():
                state_dict.setdefault(f"{at}meta.{name}", t.clone())

    def _translate(self, state_dict, prefix: str, at: str) -> None:
        """Rename, in place, the names of the earlier schemes this holder knows."""
        if not self._legacy:
            return
        for k in [k for k in state_dict if k.startswith(prefix)]:
            rel = k[len(prefix):]
            for old, channel in self._legacy.items():
                name = rel[len(old):]
                if rel.startswith(old) and name in self._tensors[channel]:
                    state_dict[at + key(channel, name)] = state_dict.pop(k)
                    break


def _refuse_other_codecs(theirs: Mapping[str, str], specs: Mapping[str, str]) -> None:
    """The channels both have must run the codecs the checkpoint's state was made for."""
    differ = [(c, theirs[c], spec) for c, spec in sorted(specs.items())
              if c in theirs and theirs[c] != spec]
    if not differ:
        return
    lines = "\n".join(f"  {c}: the checkpoint's state is for {old!r}, this model runs "
                      f"{new!r} ({option_of(c)})" for c, old, new in differ)
    options = ", ".join(sorted({option_of(c) for c, _, _ in differ}))
    raise ConfigError(
        "the checkpoint's codec state was made for other codecs (the state of one codec "
        f"means nothing to another, even where its shape fits):\n{lines}\nResume with the "
        f"codecs it was saved with ({options}), or load the parameters and optimizer only "
        "and leave the codec state out (the codecs start afresh: error feedback from "
        "zero).")


def state_of(module: torch.nn.Module) -> CodecState:
    """The :class:`CodecState` of a pipeline stage's module, attached at the first call."""
    holder = getattr(module, STAGE_ATTR, None)
    if holder is None:
        holder = CodecState()
        holder.attach(module)
    return holder
