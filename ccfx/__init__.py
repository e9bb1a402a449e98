"""ccfx: compressed communication for distributed training, as a torch.compile backend.

    compiled = torch.compile(model, backend="ccfx", options={"stages": 4, "activation_codec": "int8"})
    ccfx.plan_of(compiled)    # where the cuts are and what crosses them
    ccfx.ledger_of(compiled)  # bytes per step, raw and on the wire
"""

from . import codecs
from .config import Config
from .errors import (
    CcfxError,
    CcfxWarning,
    CodecError,
    CollectiveError,
    ConfigError,
    PartitionError,
)
from .plan import CutEdge, GraphPlan, Plan, SharedParam, Stage
from .planner.cluster import Cluster  # devices and links, for the layout planner
from .runtime import cut_op as _cut_op  # noqa: F401  (registers torch.ops.ccfx.cut)
from .runtime.shard import shard  # sharded data parallel: collectives as graph nodes
from .version import __version__ as __version__


def backend(config: Config | None = None, **options):
    """A configured backend for ``torch.compile(model, backend=ccfx.backend(...))``."""
    from ccfx.backends.compiler import CcfxBackend

    return CcfxBackend(config, **options)


def plan_parallel(model, example_inputs, cluster, *, target=None, top: int = 5, **search):
    """The fastest pipeline × data (× tensor) layout of ``model`` on ``cluster`` (a
    ``ccfx.Cluster``, a file's path or its dict) that fits in 80 % of every device's memory:
    ``best.explain()``, ``best.layout``, ``best.predicted_step_s``, ``best.peak_memory_bytes``,
    ``best.options(rank)`` for ``torch.compile(..., backend="ccfx")``. ``example_inputs`` is
    the whole step's batch. See :mod:`ccfx.backends.plan_parallel`."""
    from ccfx.backends.plan_parallel import plan_parallel as _plan

    return _plan(model, example_inputs, cluster, target=target, top=top, **search)


def plan_of(compiled) -> Plan:
    """The Plan of a model compiled with ccfx (all of its graphs); of a DDP model with ccfx's
    comm hook (:func:`ddp_comm_hook`), the hook's buckets: parameters, codec, bytes per step;
    of an FSDP2 model given ccfx's comms (``ccfx.integrations.register_codec``), each FSDP
    module's all-gather and reduce-scatter (and HSDP's all-reduce)."""
    from ccfx.backends.compiler import backend_of
    from ccfx.runtime.comm_hook import hook_state_of, plan_of_hook
    from ccfx.runtime.fsdp2_comms import fsdp2_state_of, plan_of_fsdp2

    hooked = hook_state_of(compiled)
    if hooked is not None:
        return plan_of_hook(hooked, compiled)
    sharded = fsdp2_state_of(compiled)
    if sharded is not None:
        return plan_of_fsdp2(sharded)
    return backend_of(compiled).plan


def explain(compiled) -> str:
    """What the planner (``"auto"`` codecs) chose for a compiled model, the predicted step
    time of every candidate, and why each winner won."""
    from ccfx.planner.explain import explain_plan

    return explain_plan(compiled if isinstance(compiled, Plan) else plan_of(compiled))


def ddp_comm_hook(spec: str, process_group=None, collective: str = "all_gather", *,
                  collective_timeout_s: float = 300.0):
    """``(state, hook)`` that average eager DDP's gradient buckets through a codec:
    ``ddp_model.register_comm_hook(*ccfx.ddp_comm_hook("powersgd:rank=4,ef"))``;
    ``collective="ring"`` averages non-summable payloads on ccfx's re-encoding ring;
    ``collective_timeout_s``: how long a CPU rank waits for its peers before naming them. See
    :mod:`ccfx.runtime.comm_hook`; ``"adaptive:light=int8,heavy=topk:ratio=0.01,ef"`` switches
    each bucket between two codecs over training (:mod:`ccfx.runtime.adaptive`)."""
    from ccfx.runtime.adaptive import adaptive_comm_hook, is_adaptive
    from ccfx.runtime.comm_hook import ddp_comm_hook as _ddp_comm_hook

    make = adaptive_comm_hook if is_adaptive(spec) else _ddp_comm_hook
    return make(spec, process_group, collective, collective_timeout_s=collective_timeout_s)


def delayed_comm_hook(spec: str, process_group=None, *, correct_every: int | None = None,
                      compensate: float | None = None, collective_timeout_s: float = 300.0):
    """``(state, hook)`` for eager DDP whose bucket exchanges overlap the next step (each
    gradient applied one step late), with CD-SGD's exact correction every ``correct_every``
    steps and, with ``compensate`` (λ), DC-ASGD-a's delay compensation:
    ``ddp_model.register_comm_hook(*ccfx.delayed_comm_hook("int8", correct_every=10))``.
    See :mod:`ccfx.runtime.delayed`."""
    from ccfx.runtime.delayed import delayed_comm_hook as _delayed_comm_hook

    return _delayed_comm_hook(spec, process_group, correct_every=correct_every,
                              compensate=compensate, collective_timeout_s=collective_timeout_s)


def ledger_of(compiled):
    """The byte ledger of a model compiled with ccfx; of a DDP model with ccfx's comm hook
    (:func:`ddp_comm_hook`), the hook's: bytes per bucket per step (its state's ``ledger``).
    A ccfx-compiled model inside DDP keeps its own: ``ledger_of(ddp_model.module)``. Of an
    FSDP2 model given ccfx's comms, bytes per FSDP module per collective kind per step."""
    from ccfx.backends.compiler import backend_of
    from ccfx.runtime.comm_hook import hook_state_of
    from ccfx.runtime.fsdp2_comms import fsdp2_state_of

    hooked = hook_state_of(compiled) or fsdp2_state_of(compiled)
    if hooked is not None:
        return hooked.ledger
    return backend_of(compiled).ledger


def diagnose(model=None, **options):
    """Which rank is slow (it arrives late at every exchange; its peers wait for it) and, with
    ``links=True``, which link is slow, from the timings of ccfx's DDP comm hook: a
    :class:`~ccfx.runtime.diagnose.Diagnosis` (``print`` it). Every rank calls it at the same
    point. ``diagnose_every`` runs it each n steps. See :mod:`ccfx.runtime.diagnose`."""
    from ccfx.runtime.diagnose import diagnose as _diagnose

    return _diagnose(model, **options)


def diagnose_every(model, steps: int, on_report=None, **options) -> None:
    """:func:`diagnose` every ``steps`` steps, each report to ``on_report`` (default: the
    ``ccfx`` logger); ``steps=0`` stops it."""
    from ccfx.runtime.diagnose import diagnose_every as _every

    _every(model, steps, on_report, **options)


def codec_state(compiled):
    """An ``nn.Module`` (:class:`ccfx.codecs.state.CodecState`) whose buffers are the live state
    of the stateful codecs on cut edges and data-parallel gradient buckets (error-feedback
    residuals, PowerSGD's Q), named ``<channel>.<state-name>``:
    ``graph0.edge3.hop1to2.fwd.residual``, ``graph0.bucket2.q0000`` (the scheme every ccfx
    checkpoint uses: :mod:`ccfx.codecs.state`).
    Checkpoint its ``state_dict()`` beside the model's. To resume, compile the restored model
    and ``load_state_dict`` the saved state, before or after the first call. Before it, the
    holder keeps the checkpoint and applies it as ccfx makes each channel when it compiles,
    before anything is encoded: the run goes on bit for bit. Names, shapes or dtypes that do
    not fit (another codec, other options) are a :class:`ConfigError` naming the option; so is
    a checkpoint made for another codec of the same shape, or (data parallel) another rank or
    world size: after the first call at once, before it when ccfx makes the channel. A saved
    channel this model never makes is a :class:`ConfigError` at the start of the second call
    (when the first call's forward and backward have made every channel; ``strict=False``
    drops it instead). After the first call, note that a ``no_grad`` first call compiles a
    separate inference graph with its own state."""
    from ccfx.backends.compiler import backend_of, codec_state_before_first_call

    try:
        return backend_of(compiled).codec_state
    except ConfigError:
        pass
    holder = codec_state_before_first_call(compiled)
    if holder is not None:
        return holder
    raise ConfigError(
        f"ccfx.codec_state: this {type(compiled).__name__} was not compiled with "
        "backend='ccfx': compile it with torch.compile(model, backend='ccfx', options={...}) "
        "(or backend=ccfx.backend(...)) and ask again") from None


def build_stages(compiled, rank: int | None = None, device="cpu", group=None, *,
                 style: str = "loop", dp_group=None):
    """This rank's pipeline stages of a compiled model (call it once on a microbatch first):
    ``CompressedStage`` objects (``torch.distributed.pipelining.PipelineStage``) for torch's
    schedules. ``style="loop"`` gives rank r the stages r, r + W, … (GPipe, 1F1B: one stage per
    rank; Interleaved1F1B: several); ``"v"`` gives r and 2W-1-r (ZBV). Every rank of ``group``
    (default: the world) must call it: the ranks compare their plans first. ``dp_group``
    (PP × DP): the ranks holding the same stages in the other replicas, over which
    :func:`sync_grads` averages the gradients. See :mod:`ccfx.runtime.pipeline`."""
    import torch.distributed as dist

    from ccfx.backends.compiler import backend_of
    from ccfx.runtime.pipeline import build_stages as _build

    initialized = dist.is_initialized()
    world = dist.get_world_size(group) if initialized else 1
    if rank is None:
        rank = dist.get_rank(group) if initialized else 0
    backend = backend_of(compiled)
    # each stage's data-parallel gradient codec: the backend's decision (the planner's, for
    # "auto"), written into the plan
    # gradient_collective="auto": priced on the data-parallel group's link (the cluster's
    # slowest between its ranks' devices), decided by the backend and named in the plan
    link = backend.stage_gradient_link(dp_group)
    stages = _build(backend, rank, world, device, group, style=style, dp_group=dp_group,
                    gradient_codecs=lambda parent: backend.stage_gradient_codecs(parent, dp_group),
                    gradient_link=link.link if link is not None else None)
    backend.record_stage_collectives(stages, link)
    return stages


def build_stage(compiled, rank: int | None = None, device="cpu", group=None):
    """This rank's one pipeline stage (the plan has one stage per rank); see
    :func:`build_stages` for several stages per rank."""
    stages = build_stages(compiled, rank, device, group)
    if len(stages) != 1:
        raise ConfigError(f"the plan puts {len(stages)} stages on this rank: use "
                          "ccfx.build_stages() (Interleaved1F1B takes the list)")
    return stages[0]


def sync_grads(stages) -> None:
    """After ``schedule.step()``, before ``optimizer.step()``: sum the gradients of parameters
    that several ranks' stages hold (a tied embedding and LM head) and, under PP × DP, average
    the stages' gradients over their data-parallel group through ``gradient_codec``. See
    :mod:`ccfx.runtime.stage_sync`."""
    from ccfx.runtime.stage_sync import sync_grads as _sync

    _sync(stages)


def local_steps(target, optimizer, group=None, **options):
    """Local steps for slow links (DiLoCo, Streaming DiLoCo): every ``sync_every`` steps of
    ``optimizer``, ``target``'s replicas average their pseudo-gradient through ``outer_codec``
    and an outer Nesterov SGD updates the global parameters, which every replica takes.
    ``target``: a model (compiled by ccfx with ``sync_every`` in its options, or any model
    with the options given here) or the stages ``build_stages(..., dp_group=...)`` returned.
    Returns the :class:`~ccfx.runtime.local_steps.LocalSteps` (its ``state_dict()`` belongs
    in the checkpoint); it hooks the optimizer, so the training loop is otherwise unchanged.
    See :mod:`ccfx.runtime.local_steps`; :func:`ccfx.planner.predict_outer` predicts its step.
    """
    import torch

    from ccfx.backends.compiler import backend_of, config_of
    from ccfx.runtime.local_steps import local_steps as _local_steps

    config = ledger = None
    if isinstance(target, torch.nn.Module):
        config = config_of(target)  # the options it was compiled with, if ccfx compiled it

        def ledger():  # the backend's, made at the first call
            try:
                return backend_of(target).ledger
            except ConfigError:
                return None

    return _local_steps(target, optimizer, group, compiled_config=config,
                        compiled_ledger=ledger, **options)


def gossip(model, optimizer=None, **options):
    """Compressed gossip (CHOCO-SGD) for slow links without a coordinator: after each step of
    ``optimizer`` every rank sends the compressed difference between its model and its public
    copy to its neighbours on a ring or 2-D torus and moves towards theirs; no all-reduce.
    ``options``: ``spec`` (the codec), ``gamma``, ``topology``, ``every``, ``shape``,
    ``collective_timeout_s``, ``group``. Returns the :class:`~ccfx.runtime.gossip.Gossip`
    (``consensus()``: how far the ranks' models are apart). See :mod:`ccfx.runtime.gossip`."""
    from ccfx.runtime.gossip import gossip as _gossip

    return _gossip(model, optimizer, **options)


def stage_boundary() -> None:
    """Mark a pipeline stage boundary in a model's ``forward``: ccfx cuts each graph exactly at
    its markers (one stage more than markers; no ``stages`` option needed). It is
    ``torch.distributed.pipelining.pipe_split()``, so a model marked for ccfx splits the same
    way with torch's own ``pipeline()``. Run eagerly, it does nothing."""
    from torch.distributed.pipelining import pipe_split

    pipe_split()


def draw(compiled_or_plan, path, **kw):
    """Draw a compiled model's partitioned graph (modules in one cluster per stage, codec ops
    between them) or a Plan's stages to ``path`` (.svg, .png, .pdf or .dot); see
    :func:`ccfx.viz.draw` for ``which=``, ``depth=``, ``graph=``. Returns the path written."""
    from ccfx.viz import draw as _draw

    return _draw(compiled_or_plan, path, **kw)


__all__ = [
    "CcfxError",
    "CcfxWarning",
    "Cluster",
    "CodecError",
    "CollectiveError",
    "Config",
    "ConfigError",
    "CutEdge",
    "GraphPlan",
    "PartitionError",
    "Plan",
    "SharedParam",
    "Stage",
    "backend",
    "build_stage",
    "build_stages",
    "codec_state",
    "codecs",
    "ddp_comm_hook",
    "delayed_comm_hook",
    "diagnose",
    "diagnose_every",
    "draw",
    "explain",
    "gossip",
    "ledger_of",
    "local_steps",
    "plan_of",
    "plan_parallel",
    "shard",
    "stage_boundary",
    "sync_grads",
]
