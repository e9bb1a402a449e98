"""The pipeline on real ranks: each rank runs its stages of the plan under
``torch.distributed.pipelining``'s own schedules, and what crosses a cut is the codec payload.

    compiled = torch.compile(model, backend="ccfx", options={"stages": 2, "activation_codec": "int8"})
    compiled(example_microbatch)                         # compiles and plans
    stage = ccfx.build_stage(compiled, rank, device)     # this rank's stage (a PipelineStage)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x) / schedule.step(target=y, losses=losses)

:class:`CompressedStage` is a ``PipelineStage`` that overrides public methods only: the send
ops carry the encoded payload (one flat ``uint8`` buffer per tensor) in place of the tensor,
the receive ops land in a payload buffer, and the payload is decoded into torch's own receive
buffer just before the chunk's forward or backward runs. The payload's size follows from the
shape, the dtype and the codec on both sides (``payload_layout``), so nothing else is
exchanged. Codec ``none`` leaves torch's ops as they are.

Codec state (PowerSGD's warm-start Q, error-feedback residuals) is explicit: per hop and
direction, the sending rank keeps the encoder's tensors and the receiving rank the decoder's,
made by the codec's ``init_state``, passed to every encode and decode, and registered in the
stage module's :class:`~ccfx.codecs.state.CodecState` as ``ccfx_codec_state.<channel>.<name>``,
channel ``graph0.edge3.hop1to2.fwd.send`` (``.recv``; ``.bwd.…`` for gradients; see
:mod:`ccfx.codecs.state`). ``stage.submod.state_dict()`` holds them beside the parameters, so a
checkpoint of each rank resumes with the same numerics; beside them, what they were made for
(``ccfx_codec_state.meta.``: the stage, the plan's stage count, the replica under PP × DP, each
channel's codec), so a checkpoint of another stage, plan, replica or codec is a ConfigError
saying what differs (one saved before ccfx recorded it loads unchecked). Per hop
and direction, microbatches are encoded in the same order under every schedule (0, 1, …), so
the single-process simulation, which runs the same encode and decode in that order, computes
the same values: that is what tests/test_pipeline.py checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.profiler import record_function

from .. import _torch_compat as tc
from .. import codecs
from ..codecs.state import STAGE_ATTR, edge_channel, state_of
from ..errors import CollectiveError, ConfigError
from ..passes.graph_utils import val
from ..passes.split_stages import Port, StageInterface
from ..wire import agree
from ..wire.fingerprints import short_hash
from ..wire.format import WireFormat
from ..wire.schedules import epilogue_backwards
from .ledger import Ledger
from .stage_sync import StageGradSync


def check_microbatches(schedule: str, n_microbatches: int, num_stages: int,
                       where: str = "") -> None:
    """Refuse fewer microbatches than pipeline stages under any schedule (torch's 1F1B and
    DualPipeV refuse them too, with a ValueError; GPipe would run, each rank idle most of
    the step): a :class:`ccfx.ConfigError` naming the schedule, the stages and the minimum."""
    if n_microbatches < num_stages:
        raise ConfigError(
            f"{where}{schedule} with {num_stages} pipeline stages needs at least {num_stages} "
            f"microbatches, got {n_microbatches} microbatches for {num_stages} stages: each rank "
            "would idle most of the step (the bubble). Give the schedule n_microbatches >= "
            f"{num_stages} (ccfx run: --microbatches {num_stages})")


class CompressedStage(PipelineStage):
    """A ``PipelineStage`` whose point-to-point traffic is codec payloads, both ways."""

    def __init__(self, submodule: torch.nn.Module, interface: StageInterface,
                 device: torch.device, group: dist.ProcessGroup | None = None,
                 ledger: Ledger | None = None, graph: int = 0, compiled: bool = False,
                 epilogue_only: str | None = None):
        self.interface = interface
        #: Optimus-CC's epilogue-only compression under this schedule ("1F1B", "GPipe"):
        #: backward sends are compressed only after the sending stage's last forward.
        self.epilogue_only = epilogue_only
        self.ledger = ledger
        #: The stage module runs compiled (lowering "inductor").
        self.compiled = compiled
        self.graph = graph
        d = torch.device(device)
        inputs = tuple(_example(p, d) for p in interface.inputs)
        outputs = (tuple(_example(p, d) for p in interface.outputs) if interface.outputs
                   else _last_outputs(submodule, d))
        super().__init__(submodule, interface.index, interface.num_stages, d,
                         input_args=inputs, output_args=outputs, group=group)
        # One wire format per hop and direction, on the side that uses it; its state tensors
        # (stateful codecs) in self._state, under the same role.
        self._send_fwd = [_wire(p, p.codec) for p in interface.outputs]
        self._recv_bwd = [_wire(p, p.grad_codec) for p in interface.outputs]
        self._recv_fwd = [_wire(p, p.codec) for p in interface.inputs]
        self._send_bwd = [_wire(p, p.grad_codec) for p in interface.inputs]
        self._raw_recv_bwd = [_wire(p, "none") for p in interface.outputs]
        self._raw_send_bwd = [_wire(p, "none") for p in interface.inputs]
        self._state = self._register_codec_state(d)
        #: (kind, chunk) → [(torch's receive buffer, payload buffer, wire format, its state)]
        self._pending: dict[tuple[str, int], list] = {}
        #: Parameters other ranks' stages hold too (a tied embedding and LM head): name →
        #: (the process group of the ranks that hold it, their ranks). Set by build_stages.
        self.shared: dict[str, tuple[dist.ProcessGroup | None, tuple[int, ...]]] = {}
        self._unsynced = False

    # -- state ------------------------------------------------------------------------------

    def _register_codec_state(self, device: torch.device) -> dict[str, list[dict]]:
        """Each wire's state tensors (empty dicts for stateless codecs), by role; stateful ones
        registered in the stage module's codec state."""
        out = {}
        for role, wires, ports in (("send_fwd", self._send_fwd, self.interface.outputs),
                                   ("recv_bwd", self._recv_bwd, self.interface.outputs),
                                   ("recv_fwd", self._recv_fwd, self.interface.inputs),
                                   ("send_bwd", self._send_bwd, self.interface.inputs)):
            out[role] = []
            for w, p in zip(wires, ports, strict=True):
                state = w.init_state(device)
                if state:
                    side, direction = role.split("_")
                    channel = edge_channel(self.graph, p.edge, p.hop, direction, side)
                    state = state_of(self.submod).add(
                        channel, w.codec.spec, state, legacy=f"{STAGE_ATTR}.edge{p.edge}_{role}_")
                out[role].append(state)
        # the raw variants (epilogue-only compression) are stateless
        out["raw_recv_bwd"] = [{} for _ in self._raw_recv_bwd]
        out["raw_send_bwd"] = [{} for _ in self._raw_send_bwd]
        return out

    # -- forward ----------------------------------------------------------------------------

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        sends = [(k, out) for k, out in enumerate(outputs) for dst in self.act_send_info[k]
                 if dst is not None]
        self._note(ops, "sending", "forward activation", fwd_chunk_id, self.stage_index + 1)
        return [self._send(op, self._send_fwd[k], self._state["send_fwd"][k], out, k, "fwd")
                for op, (k, out) in zip(ops, sends, strict=True)]

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        infos = self.args_recv_info[fwd_chunk_id]
        self._note(ops, "receiving", "forward activation", fwd_chunk_id, self.stage_index - 1)
        return self._recvs(ops, infos, self._recv_fwd, self._state["recv_fwd"],
                           ("fwd", fwd_chunk_id))

    def _prepare_forward_infra(self, num_microbatches: int, *args, **kwargs):
        check_microbatches("the schedule", num_microbatches, self.num_stages,
                           where=f"stage {self.stage_index}: ")
        return super()._prepare_forward_infra(num_microbatches, *args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output=True):
        if self.is_first:
            self._check_shapes(args)
        if self._unsynced:
            raise ConfigError(
                f"stage {self.stage_index}: the gradients of {sorted(self.shared)} (held by the "
                "stages of several ranks) were not summed after the last step: call "
                "ccfx.sync_grads(stages) after schedule.step() and before "
                "optimizer.step() (the last update used partial gradients)")
        if fwd_chunk_id == 0 and self.ledger is not None:  # a schedule's step begins
            self.ledger.count_call((self.graph, "stage", self.stage_index))
        self._decode_pending(("fwd", fwd_chunk_id))
        with record_function(f"ccfx stage {self.stage_index} forward mb{fwd_chunk_id}"):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    # -- backward ---------------------------------------------------------------------------

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if not ops:
            return ops
        sent = [k for k, stage in enumerate(self.grad_send_info)
                if stage is not None and self._get_grad_send_meta(k) is not None]
        role = ("send_bwd" if self._compressed_bwd(bwd_chunk_id, self.stage_index)
                else "raw_send_bwd")
        wires, states = getattr(self, f"_{role}"), self._state[role]
        self._note(ops, "sending", "backward gradient", bwd_chunk_id, self.stage_index - 1)
        return [self._send(op, wires[k], states[k], op.tensor, k, "bwd")
                for op, k in zip(ops, sent, strict=True)]

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        if not ops:
            return ops
        infos = self.grad_recv_info[bwd_chunk_id]
        self._note(ops, "receiving", "backward gradient", bwd_chunk_id, self.stage_index + 1)
        role = ("recv_bwd" if self._compressed_bwd(bwd_chunk_id, self.stage_index + 1)
                else "raw_recv_bwd")
        return self._recvs(ops, infos, getattr(self, f"_{role}"), self._state[role],
                           ("bwd", bwd_chunk_id))

    def _compressed_bwd(self, chunk: int, sender: int) -> bool:
        """Whether the backward send of ``chunk`` from stage ``sender`` carries its codec:
        always, or under ``epilogue_only`` when it comes after the sender's last forward (both
        ends derive that from the schedule's program)."""
        if self.epilogue_only is None:
            return True
        return chunk in epilogue_backwards(self.epilogue_only, sender, self.num_stages,
                                           self.chunks)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        if not full_backward and self.compiled:
            raise ConfigError(
                f"stage {self.stage_index}: this schedule splits the backward into input and "
                "weight gradients (zero bubble), which fails with compiled stages upstream "
                "(pytorch#161904): compile with lowering='eager' for zero-bubble schedules")
        self._decode_pending(("bwd", bwd_chunk_id))
        if last_backward and self.shared:
            self._unsynced = True
        with record_function(f"ccfx stage {self.stage_index} backward mb{bwd_chunk_id}"):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    # -- V schedules: neighbouring stages on one rank pass tensors by a call ---------------
    # The plan puts a codec on every hop, and the simulation applies it: so does a local hop
    # (no bytes go on a wire, and the ledger counts none).

    def set_local_fwd_input(self, prev_stage_outputs, mb_index: int) -> None:
        outs = prev_stage_outputs if isinstance(prev_stage_outputs, tuple) else (prev_stage_outputs,)
        super().set_local_fwd_input(tuple(
            w.roundtrip(t, state) for w, state, t in
            zip(self._recv_fwd, self._state["recv_fwd"], outs, strict=True)), mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        super().set_local_bwd_input(tuple(
            None if g is None else w.roundtrip(g, state)
            for w, state, g in zip(self._recv_bwd, self._state["recv_bwd"],
                                   next_stage_bwd_outputs, strict=True)), mb_index)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._pending.clear()

    def _check_shapes(self, args) -> None:
        got = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        want = [p.shape for p in self.interface.inputs]
        if got != want:
            raise self._refuse(ConfigError(
                f"stage {self.stage_index} (rank {self.group_rank}): a microbatch of shapes "
                f"{got}, but the plan was made for {want}: every rank allocates its buffers "
                "for one microbatch shape. Keep the batch size constant (drop a last, "
                "smaller batch) or compile and build the stages again for the new shape"))

    # -- what a failed transfer was about ---------------------------------------------------

    def _note(self, ops, verb: str, what: str, chunk: int, peer_stage: int) -> None:
        where = "to" if verb == "sending" else "from"
        for op in ops:
            _IN_FLIGHT.append(
                f"stage {self.stage_index} {verb} the {what} of microbatch {chunk} {where} "
                f"stage {peer_stage} (rank {op.peer})")
            _IN_FLIGHT_PEERS.add(op.peer)

    def _refuse(self, e: ConfigError) -> ConfigError:
        """Record that this rank gives up (its peers' errors quote why), then close its
        connections of the stages' group: a peer blocked on a transfer with this rank fails at
        once and quotes the record, instead of after ``collective_timeout_s``
        (:func:`ccfx.wire.agree.close_group`; the group is finished). Returns ``e``."""
        agree.gave_up(f"pipeline stage {self.stage_index}", str(e))
        agree.close_group(getattr(self.group, "group_name", None))
        return e

    # -- the swap ---------------------------------------------------------------------------

    def _send(self, op: dist.P2POp, wire: WireFormat, state: dict, tensor: torch.Tensor, k: int,
              direction: str) -> dist.P2POp:
        port = (self.interface.outputs if direction == "fwd" else self.interface.inputs)[k]
        if tuple(tensor.shape) != wire.shape:
            raise self._refuse(ConfigError(
                f"stage {self.stage_index} (rank {self.group_rank}): {port.name} has shape "
                f"{tuple(tensor.shape)}, the plan says {wire.shape}: the microbatch shape "
                "changed since the stages were built"))
        if wire.raw:
            self._count(port, direction, wire.raw_bytes, wire.raw_bytes)
            return op
        with record_function(f"ccfx encode {direction} {port.name} ({wire.codec.spec})"):
            payload = wire.encode(tensor, state)
        self._count(port, direction, wire.raw_bytes, payload.numel())
        return dist.P2POp(op.op, payload, op.peer, op.group, op.tag)

    def _recvs(self, ops, infos, wires, states, key) -> list[dist.P2POp]:
        by_buffer = {id(info.buffer): k for k, info in enumerate(infos)
                     if not info.is_root_arg and info.buffer is not None}
        out, pending = [], []
        for op in ops:
            k = by_buffer[id(op.tensor)]
            wire = wires[k]
            if wire.raw:
                out.append(op)
                continue
            payload = torch.empty(wire.nbytes, dtype=torch.uint8, device=op.tensor.device)
            pending.append((op.tensor, payload, wire, states[k]))
            out.append(dist.P2POp(op.op, payload, op.peer, op.group, op.tag))
        if pending:
            self._pending[key] = pending
        return out

    def _decode_pending(self, key) -> None:
        for buffer, payload, wire, state in self._pending.pop(key, ()):
            with record_function(f"ccfx decode {key[0]} mb{key[1]} ({wire.codec.spec})"):
                wire.decode_into(payload, buffer, state)

    def _count(self, port: Port, direction: str, raw: int, wire: int) -> None:
        if self.ledger is not None:
            self.ledger.record(self.graph, port.edge, port.hop, direction, raw, wire)


#: The transfers requested since the last completed wait (what a failed wait was about).
_IN_FLIGHT: list[str] = []
_IN_FLIGHT_PEERS: set[int] = set()  # their peers (global ranks), since the last failure
_EARLIER: list[str] = []  # the last few completed ones (a send is waited for later)


def _wait_batch_p2p(work) -> None:
    """torch's schedules' wait for a batch of sends and receives, with a failure (a dead,
    frozen or diverged peer: gloo's error, after ``collective_timeout_s`` on ccfx's pipeline
    group) turned into a :class:`CollectiveError` naming this rank, the peer stage and rank and
    the microbatch awaited."""
    try:
        _TORCH_WAIT(work)
    except RuntimeError as e:
        _raise_transfer_failed(e)
    if _IN_FLIGHT:
        _EARLIER[:] = (_EARLIER + _IN_FLIGHT)[-8:]
    _IN_FLIGHT.clear()


def _batch_p2p(p2p_ops, desc=None):
    """torch's schedules' posting of a batch of sends and receives, with the same error as a
    failed wait: gloo refuses to post on a connection the peer has already closed, so a rank
    whose peer gave up between two steps fails here, before it waits for anything."""
    try:
        return _TORCH_POST(p2p_ops, desc)
    except RuntimeError as e:
        _raise_transfer_failed(e)


def _raise_transfer_failed(e: RuntimeError) -> None:
    """Raise ``e`` as a :class:`CollectiveError` that says what was in flight, with whom, and
    why the peer stopped (its recorded reason, or who closed the connection)."""
    if isinstance(e, CollectiveError) or not (_IN_FLIGHT or _EARLIER):
        raise e
    # a schedule waits for its sends later than for its receives: a failed wait with
    # nothing requested since the last one is about the sends requested before it
    awaited = "; ".join(dict.fromkeys(_IN_FLIGHT or [n for n in _EARLIER
                                                     if " sending " in n] or _EARLIER))
    peers = sorted(_IN_FLIGHT_PEERS)
    _IN_FLIGHT.clear()
    _IN_FLIGHT_PEERS.clear()
    _EARLIER.clear()
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    agree.gave_up("a pipeline transfer", first, peers)
    failed = agree.peer_failures(peers)
    cause = "".join(f" Rank {r} gave up first: {_unquoted(why).rstrip('.')}."
                    for r, why in failed.items())
    who = "" if failed else agree.blame(e, peers)
    who = f" {who[0].upper()}{who[1:]}." if who else ""
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise CollectiveError(
        f"rank {rank}: a pipeline transfer failed ({awaited}): {first}.{cause}{who} A peer "
        "rank died, hung past collective_timeout_s, or ran a different step; see that "
        "rank's own error.") from e


def _unquoted(text: str) -> str:
    """A peer's recorded reason as text (the record keeps a shortened one as a JSON string)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:  # shortened: cut inside the string ('"stage 0 ... smaller…')
        return text[1:].replace('\\"', '"') if text.startswith('"') else text
    return value if isinstance(value, str) else text


def _install_wait() -> None:
    """Route torch's schedules' posting and waiting through the two wrappers above. A
    PipelineStage override cannot: the stage makes the P2P ops (``dist.P2POp`` takes only
    ``isend``/``irecv``), the schedule posts them and waits for torch's own ``Work``."""
    wait, post = tc.pipeline_p2p()
    if wait is None or post is None or getattr(wait, "_ccfx", False):
        return  # another torch (the schedules wait elsewhere: raw errors), or done already
    global _TORCH_WAIT, _TORCH_POST
    _TORCH_WAIT, _TORCH_POST = wait, post
    for ours in (_wait_batch_p2p, _batch_p2p):
        ours._ccfx = True  # type: ignore[attr-defined]
    tc.set_pipeline_p2p(_wait_batch_p2p, _batch_p2p)


_TORCH_WAIT = _TORCH_POST = None


def _wire(port: Port, spec: str) -> WireFormat:
    codec = codecs.prototype(spec)  # shared: the state is the stage's (CompressedStage._state)
    if not codec.applies_to(port.dtype):
        codec = codecs.prototype("none")
    return WireFormat(codec, port.shape, port.dtype)


def _example(port: Port, device: torch.device) -> torch.Tensor:
    return torch.empty(port.shape, dtype=port.dtype, device=device).requires_grad_(
        port.requires_grad)


def _last_outputs(submodule: torch.nn.Module, device: torch.device):
    output = next(n for n in submodule.graph.nodes if n.op == "output")
    values = []
    torch.fx.map_arg(output.args[0], lambda n: values.append(val(n)))
    return tuple(torch.empty(v.shape, dtype=v.dtype, device=device).requires_grad_(
        bool(v.requires_grad)) for v in values)


# -- building a rank's stages ------------------------------------------------------------------


def stage_indices(rank: int, world: int, num_stages: int, style: str = "loop") -> list[int]:
    """The stages a rank runs: ``loop`` (GPipe, 1F1B, Interleaved1F1B: rank r holds r, r+W,
    …) or ``v`` (ZBV, DualPipeV: rank r holds r and 2W-1-r)."""
    if num_stages % world:
        raise ConfigError(f"the plan has {num_stages} stages, which {world} pipeline ranks "
                          "cannot share evenly: compile with stages = a multiple of the ranks")
    if style == "v":
        if num_stages != 2 * world:
            raise ConfigError(f"a V schedule runs 2 stages per rank: compile with stages="
                              f"{2 * world} for {world} ranks (the plan has {num_stages})")
        return [rank, 2 * world - 1 - rank]
    if style != "loop":
        raise ConfigError(f"unknown stage placement {style!r}: use 'loop' or 'v'")
    return list(range(rank, num_stages, world))


def fingerprint(interfaces: Sequence[StageInterface]) -> str:
    """A hash of what every stage sends and receives (shapes, dtypes, codecs): ranks compare
    it before the first step, so disagreeing ranks fail with an error instead of garbage."""
    text = repr([(i.index, i.num_stages, i.inputs, i.outputs) for i in interfaces])
    return short_hash(text)


def plan_description(interfaces: Sequence[StageInterface]) -> dict:
    """What the pipeline ranks agree on, readable where it differs
    (:func:`ccfx.wire.agree.diff` names the keys): each cut edge's hop and direction with its
    codec (``"edge 3 (stage 1 -> 2), forward": "int8"``), each stage's interface without the
    codecs (names, shapes, dtypes: a fingerprint) and the number of stages."""
    desc: dict = {"num_stages": len(interfaces)}
    for i in interfaces:
        for p in i.outputs:
            where = f"edge {p.edge} (stage {p.hop[0]} -> {p.hop[1]})"
            desc[f"{where}, forward"] = p.codec
            desc[f"{where}, backward"] = p.grad_codec
        ports = [[(p.name, p.edge, p.hop, p.shape, str(p.dtype), p.requires_grad)
                  for p in ps] for ps in (i.inputs, i.outputs)]
        desc[f"stage {i.index} shapes"] = short_hash(repr((i.index, i.num_stages, ports)))
    return desc


def check_same_plan(interfaces: Sequence[StageInterface], group: dist.ProcessGroup | None,
                    rank: int, timeout_s: float = 300.0) -> str:
    """The ranks of ``group`` agree on the stage plan (:func:`ccfx.wire.agree.meet`, keyed by
    its fingerprint: ranks with different plans fail naming what differs, as
    ``edge 3 (stage 1 -> 2), forward ("int8" vs "fp8")``: this rank's codec, then the peer's;
    or the stages whose shapes differ); returns the agreement's fingerprint."""
    from ..wire import agree

    desc = plan_description(interfaces)
    if not dist.is_initialized():
        return agree.fingerprint(desc)
    return agree.meet(
        "a pipeline's stage plan", desc, agree.world_ranks(group), timeout_s=timeout_s,
        hint="(Each difference reads: this rank's value vs the peer's.) The pipeline ranks "
             "planned different stages: every rank must compile the same model with the same "
             "options (activation_codec, activation_grad_codec, codec_overrides) and the same "
             "microbatch shape.")


#: ``gradient_codecs(parent) -> per-stage codecs``: the data-parallel gradient codec of each
#: stage under PP × DP, decided by the backend (``gradient_codec``, ``gradient_codec_stages``,
#: or the planner's ``auto`` choice, recorded in the plan); ``parent`` is the split graph.
GradientCodecs = Callable[[torch.fx.GraphModule], Sequence[str]]


def build_stages(backend, rank: int, world: int, device, group=None, *, style: str = "loop",
                 graph: int = 0, check: bool = True, dp_group=None,
                 gradient_codecs: GradientCodecs | None = None,
                 gradient_link=None) -> list[CompressedStage]:
    """This rank's stages of graph ``graph`` of a compiled model (see :func:`stage_indices`);
    ``rank`` and ``world`` are this rank's place in the pipeline ``group``; ``dp_group``: the
    ranks that run the same stages in the other replicas (PP × DP). ``backend``: what the
    model compiled to (its ``graphs``, ``config`` and ``ledger``). ``gradient_codecs``: each
    stage's data-parallel gradient codec, decided by the backend (default:
    ``gradient_codec`` for every stage, which must then not be ``"auto"``).
    ``gradient_link``: the link ``gradient_collective="auto"`` is priced on for ``dp_group``
    (a ``ccfx.wire.link.Link``, the backend's decision; default the ``link_gbps`` link).

    From here on the model's ledger counts what this rank's stages send, a step per schedule
    step: the rows of the calls before (the simulation that compiled and planned it, in one
    process: no byte of it crossed a wire) are cleared."""
    graphs = backend.graphs
    if not graphs:
        raise ConfigError("the model has not been compiled yet: call it once on a microbatch "
                          "before building pipeline stages")
    if len(graphs) > 1 and graph == 0:
        raise ConfigError(_several_graphs(graphs))
    parent = graphs[graph].split()
    interfaces = parent.meta["ccfx"]["interfaces"]
    plan_fp = fingerprint(interfaces)
    if check:
        check_same_plan(interfaces, group, rank, backend.config.collective_timeout_s)
    mine = stage_indices(rank, world, len(interfaces), style)
    cfg = backend.config
    group = _p2p_group(group, plan_fp, cfg.collective_timeout_s)
    _install_wait()
    epilogue = cfg.pipeline_schedule if cfg.epilogue_only else None
    out = []
    for s in mine:
        child = lower_stage(getattr(parent, f"stage_{s}"), cfg.lowering)
        out.append(CompressedStage(child, interfaces[s], device, group, backend.ledger, graph,
                                   compiled=cfg.lowering == "inductor", epilogue_only=epilogue))
    _share(out, interfaces, rank, world, style, group, plan_fp, cfg.collective_timeout_s)
    codec = _rank_codec(gradient_codecs, parent, mine, cfg, dp_group)
    sync = StageGradSync(out, backend.config, dp_group, backend.ledger, graph, codec,
                         gradient_link)
    for st in out:
        st.grad_sync = sync
    _record_place(out, len(interfaces), dp_group)
    backend.ledger.reset()
    return out


def _several_graphs(graphs) -> str:
    """Why a model Dynamo captured as several graphs has no pipeline on real ranks: the
    stages are one graph's, so the other graphs' code (and the Python between them) would not
    run on any rank. In one process (simulation) each graph keeps its own stages, and small
    or parameterless graphs are left whole (README, Graph breaks)."""
    parts = []
    for g in graphs:
        plan = g.plan
        whole = " (left whole)" if getattr(plan, "left_whole", "") else ""
        parts.append(f"graph {g.index}: {plan.num_stages} stage(s){whole}")
    return (f"the model compiled to {len(graphs)} graphs (graph breaks: {'; '.join(parts)}): "
            "a pipeline on real ranks runs the stages of one graph, and the other graphs' code "
            "(and the Python between them) would run on no rank. Compile with fullgraph=True "
            "(Dynamo then names the break) and remove it, or keep what breaks the graph outside "
            "the compiled module (compute the loss from its output, build masks before calling "
            "it); in one process, ccfx simulates each graph's stages")


def _record_place(stages: list[CompressedStage], num_stages: int, dp_group) -> None:
    """What each stage's codec state was made for, in its ``meta.`` (stages without codec
    state get none: their ``state_dict()`` stays the parameters'): the stage, the plan's stage
    count, and the replica under PP × DP (the buckets' error feedback is the replica's own).
    A checkpoint made for another stage, plan or replica is then a ConfigError at load
    (:func:`ccfx.codecs.state.check_place`); one saved before ccfx recorded this loads
    unchecked."""
    dp_world = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    for st in stages:
        holder = getattr(st.submod, STAGE_ATTR, None)
        if holder is None or not holder.channels():
            continue
        for name, value in (("stage", st.stage_index), ("num_stages", num_stages),
                            ("dp_world_size", dp_world), ("dp_rank", dp_rank)):
            holder.set_meta(name, value)


def _p2p_group(group, plan_fp: str, timeout_s: float):
    """The stages' point-to-point group: ccfx's own over the same ranks, whose timeout is
    ``collective_timeout_s`` (a frozen peer fails a send or receive within it, not within the
    default group's 30 minutes); ``group`` itself where its ranks are not in order."""
    if not dist.is_initialized():
        return group
    ranks = agree.world_ranks(group)
    if len(ranks) < 2 or list(ranks) != sorted(ranks):
        return group
    return agree.group("a pipeline's point-to-point transfers", {"plan": plan_fp}, ranks,
                       timeout_s=timeout_s)


def _rank_codec(gradient_codecs: GradientCodecs | None, parent, mine: list[int], cfg,
                dp_group) -> str:
    """This rank's data-parallel gradient codec: the first of its stages' codecs that
    compresses (``"none"`` if none does)."""
    if dp_group is None or dist.get_world_size(dp_group) < 2:  # nothing to average
        return "none" if cfg.gradient_codec == "auto" else cfg.gradient_codec
    if gradient_codecs is None:
        if cfg.gradient_codec == "auto":
            raise ConfigError("gradient_codec='auto' under PP x DP is decided by the backend: "
                              "build the stages with ccfx.build_stages()")
        return cfg.gradient_codec
    codecs_ = list(gradient_codecs(parent))
    return next((codecs_[s] for s in mine if codecs_[s] != "none"), "none")


def _share(stages: list[CompressedStage], interfaces, rank: int, world: int, style: str,
           group, plan_fp: str = "", timeout_s: float = 300.0) -> None:
    """A process group per parameter that several ranks' stages hold, made by those ranks
    only, in name order, named by the plan's fingerprint and the parameter
    (:func:`ccfx.wire.agree.group`: not by how many groups the process made before)."""
    from ..wire import agree

    owner = {s: r for r in range(world) for s in stage_indices(r, world, len(interfaces), style)}
    holders: dict[str, set[int]] = {}
    for i in interfaces:
        for name in i.params:
            holders.setdefault(name, set()).add(owner[i.index])
    for name in sorted(holders):
        ranks = tuple(sorted(holders[name]))
        if len(ranks) < 2:
            continue
        global_ranks = ([dist.get_global_rank(group, r) for r in ranks] if group is not None
                        else list(ranks))
        if rank not in ranks:
            continue
        pg = agree.group("a parameter held by several pipeline ranks",
                         {"plan": plan_fp, "param": name}, global_ranks, timeout_s=timeout_s)
        for st in stages:
            if name in st.interface.params:
                st.shared[name] = (pg, ranks)


def lower_stage(child: torch.fx.GraphModule, lowering: str) -> torch.nn.Module:
    """The stage module as the simulation lowers it: eager runs the graph's torch ops as they
    are; inductor compiles the stage (its forward; autograd gives the backward)."""
    if lowering == "inductor":
        child.forward = torch.compile(child.forward, backend="inductor", fullgraph=True)
    return child
