"""``Config``: every option ccfx takes, in one place.

The same keys work as ``torch.compile(..., backend="ccfx", options={...})`` and as
``ccfx.backend(ccfx.Config(...))``. Later features add fields here, nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

BALANCE = ("flops", "params", "memory")
#: The codec value that asks the planner (``ccfx.planner``) to choose.
AUTO = "auto"
SCHEDULES = ("1F1B", "GPipe")
#: What ``auto`` minimises on pipeline edges (``objective``).
OBJECTIVES = ("step", "time_to_loss")
LOWERING = ("inductor", "eager")
#: ``shard_bucket``: one all-gather / reduce-scatter per block of ccfx.shard's parameters, or
#: one per parameter
SHARD_BUCKET = ("block", "none")
#: How non-summable payloads are averaged (``gradient_collective``, ``outer_collective``).
COLLECTIVES = ("all_gather", "ring", AUTO)
#: The collectives ``collective_overrides`` names by kind (``ccfx.wire.collectives.KINDS``).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: Environment variable holding a JSON object of options, for frameworks that pass only a
#: backend name (``TrainingArguments(torch_compile_backend="ccfx")``). Explicit options win.
OPTIONS_ENV = "CCFX_OPTIONS"


@dataclass(frozen=True)
class Config:
    """Options of the ccfx backend.

    stages: number of pipeline stages to cut each graph into (≥ 1).
    activation_codec: codec on every cut edge, forward and backward (a spec, see
        ``ccfx codecs``): "none", "fp16", "bf16", "int8", "int8:block=128", ...
    activation_grad_codec: codec on the activation gradients that cross the cuts backward;
        None (default): the same as ``activation_codec``. Optimus-CC's compressed
        backpropagation is ``activation_codec="none", activation_grad_codec="powersgd:rank=16"``.
    codec_overrides: codecs for some cut edges, beating ``activation_codec`` /
        ``activation_grad_codec``: ``{"edge 3": "int8", "stage 1": "none/powersgd:rank=16"}``.
        ``"edge N"`` is the plan's edge N (in every graph); ``"stage S"`` every edge leaving
        stage S; an edge entry beats a stage entry. A value is one spec (both directions) or
        ``"forward/backward"``.
    split_points: module qualified names (``"layers.2"``) to cut before; when given, they are the
        cuts, and ``stages`` is ``len(split_points) + 1``.
    balance: the cost the partitioner balances: "flops", "params" (parameter bytes) or
        "memory" (activation bytes).
    lowering: what runs the partitioned graphs after aot_autograd: "inductor" (default; fastest
        on CPU and CUDA) or "eager" (aten ops one by one: quick to compile, for tests).
    fuse_codecs: under inductor, give each cut's codec to inductor as plain ops it fuses with
        the kernels around it, where the codec is stateless and of fixed size (int8, fp8,
        fp16, none, ...; the ledger counts the same bytes); False keeps every cut an opaque op.

    Data parallel (gradients averaged over the ranks of the default process group, from
    inside the compiled backward; no DDP wrapper):

    data_parallel: synchronize parameter gradients across ranks. Without a process group it
        runs as world size 1 (each bucket's codec applied as a local round trip).
    gradient_codec: codec on each gradient bucket ("none", "fp16", "powersgd:rank=4", "int8",
        "topk:ratio=0.01,ef", ...). Sum-compatible codecs all-reduce; others all-gather.
    bucket_mb: bucket size cap in MiB; gradients fill buckets in the order backward makes them.
    compress_min_numel: parameters with fewer elements, and every 0-d/1-D parameter (biases,
        norms), go in uncompressed buckets.
    min_compression_rate: a bucket whose codec would not shrink it by at least this factor
        (raw / wire) is sent uncompressed.
    warmup_steps: this many first backward passes are all-reduced uncompressed (PowerSGD's
        ``start_powerSGD_iter``), then the codec starts.
    error_feedback: wrap the gradient codec in error feedback (same as appending ",ef").
    collective_timeout_s: how long a rank waits on a gradient collective before failing with
        an error naming the rank and the bucket (a peer died or diverged).
    broadcast_buffers: as DDP's default, every forward with grad enabled starts from rank 0's
        buffers (BatchNorm statistics), broadcast; False keeps them per rank.

    The planner (``"auto"`` as ``activation_codec``, ``activation_grad_codec`` or
    ``gradient_codec``: each edge, direction and bucket gets the codec with the lowest
    predicted step time, ``none`` where compression does not pay; ``ccfx.explain(compiled)``
    says why):

    link_gbps: the link's bandwidth in Gbit/s (0.1 for 100 Mbit/s); required by ``auto``.
    link_latency_ms: its one-way latency in milliseconds.
    link_shared: every rank's traffic crosses one medium (one switch port, a shaped loopback)
        rather than a link per pair of ranks.
    pipeline_schedule: the schedule the pipeline runs ("1F1B" or "GPipe"), and
    microbatches: how many microbatches a step has; compile at the microbatch shape.
    auto_loss_budget: codecs whose measured effect on the final loss (bench/convergence.py)
        exceeds this fraction are not candidates (default 0.01: 1 %).
    auto_candidates: more codec specs for ``auto`` to consider, beyond the measured ones.
    auto_min_gain: a lossy codec is chosen only if it makes the predicted step at least this
        fraction faster than ``none`` (default 0.10: the cost model's typical error on the
        shaped harness, bench/planner.py; a smaller predicted gain is no gain).
    objective: what ``auto`` minimises on the pipeline's cut edges: "step" (default: the
        predicted step) or "time_to_loss" (T = steps multiplier × predicted step: the steps a
        choice needs to reach a loss target over uncompressed's, from
        ``steps_multipliers``; candidates are the table's codecs, with no loss budget).
    steps_multipliers: the steps-multiplier table for ``objective="time_to_loss"``: the JSON
        file ``bench/time_to_loss.py --table`` writes, JSON text, or a dict ``{"activation":
        {"int8": 1.02}, "activation_grad": {...}}``; None: the one measured on this project's
        machine (``ccfx.steps_table``). Kept as canonical JSON, like ``cluster``.

    Optimus-CC's techniques (Song et al., ASPLOS'23):

    lazy_error_propagation: every backward cut codec carries error feedback: the residual a
        hop's codec dropped from one microbatch's activation gradient is added to the next
        microbatch's before encoding (same as appending ",ef" to the backward codecs).
    gradient_codec_stages: under PP × DP, the pipeline stages whose data-parallel gradients go
        through ``gradient_codec`` (the others: uncompressed); None: every stage. With
        ``gradient_codec="auto"`` the planner picks them: the stages whose exchange ends the
        step (selective stage compression).
    epilogue_only: on real pipeline ranks, compress only the backward sends of the
        schedule's cool-down (those after the sending stage's last forward, which nothing
        overlaps); the rest travel raw. ``pipeline_schedule`` says which sends those are.
        The single-process simulation has one microbatch and compresses every backward.

    How a compressed gradient bucket or pseudo-gradient fragment is averaged (codecs whose
    payloads cannot be summed: int8, int4, topk, ...):

    gradient_collective: "all_gather" (every rank decodes every payload; receive bytes grow
        with the world), "ring" (a ring that re-encodes at every hop and accumulates in fp32,
        then all-gathers the reduced chunks' bytes so every rank decodes the same bytes:
        2(W-1)/W of a payload per rank) or "auto" (the cheaper for this world size and link).
        Sum-compatible codecs (none, fp16, bf16) always all-reduce.

    Compressed collectives (every functional collective in the compiled forward, backward and
    inference graphs: DTensor tensor / sequence parallel, sharded parameters gathered in the
    graph, the user's own funcol code; ``backends.collectives``):

    collective_codec: the codec of every all_reduce, all_gather, reduce_scatter and all_to_all
        ("none" (default): left as they are, "int8", "fp8", "int4:ef", "bf16", ..., or
        "auto": the planner prices each one on the link, ``link_gbps`` and friends, and
        compresses it only where that is predicted faster: ``ccfx.explain`` says why). A
        collective a codec cannot carry (a max reduction, integer data, a group of one) runs
        unchanged, and the plan says why.
    cluster: the devices and the links between them (``ccfx.Cluster``: a ``.toml`` / ``.json``
        file's path, or the dict of ``Cluster.to_dict()``), rank r on its device r: ``auto``
        prices each collective on the slowest link among its group's devices instead of
        ``link_gbps`` (a TP group inside a node, a data-parallel group across nodes). Kept as
        the canonical JSON of the description, so ranks agree whatever path they read it from.
        With ``cluster``, ``auto`` also prices each pipeline hop on the link between its two
        stages' devices and each data-parallel group's buckets on its slowest link.
    placement: with ``cluster``, the device of each rank (``placement[r]``: a device's name or
        index), where rank r does not run on device r; in the single-process simulation, the
        device of each stage. Under PP × DP ranks count as a ``("dp", "pp")`` DeviceMesh does:
        replica d's stage s is rank ``d × stages + s``. Kept as device indices.
    collective_overrides: codecs for some collectives, beating ``collective_codec``:
        ``{"reduce_scatter": "int4:ef", "all_gather": "int8", "collective 3": "none"}``, by
        kind or by the plan's index (``"collective N"``, in every graph); an index beats a
        kind. A key that matches no collective of the model's graphs is a ConfigError listing
        them (at the second call of a training graph, when its backward has compiled).
    shard_bucket: how ``ccfx.shard``'s parameter collectives are grouped ("block" (default): the
        all-gathers of one block's parameters (``blocks.3``, a module path up to its first
        index) become one all-gather, their gradients' reduce-scatters one reduce-scatter,
        so each block pays one latency and, compressed, one encode; "none": one per
        parameter). Results are the same bits with codec ``none``. Collective indices
        (``"collective N"``) count the buckets.

    Local steps (DiLoCo for slow links; ``ccfx.local_steps(model, optimizer)`` runs it):

    sync_every: H, the inner optimizer steps each replica takes between syncs (None: no local
        steps). At every sync the pseudo-gradient (global minus local parameters) is averaged
        across replicas through ``outer_codec`` and an outer optimizer updates the global
        parameters, which every replica then takes. H = 1 with ``outer_lr=1``,
        ``outer_momentum=0`` and codec none is per-step data parallel.
    outer_codec: the pseudo-gradient's codec ("none", "bf16", "int8", "int4", "fp8",
        "topk:ratio=0.01,ef", "powersgd:rank=8", ...).
    outer_lr, outer_momentum, outer_nesterov: the outer SGD (DiLoCo: 0.7, 0.9, Nesterov).
    outer_collective: as ``gradient_collective``, for the pseudo-gradient.
    fragments: split the parameters into this many fragments (of about equal size, each
        spanning the model's depth) synced in turn, one every H / fragments steps (Streaming
        DiLoCo).
    fragment_delay: τ, inner steps a fragment's sync runs in the background, overlapped with
        compute, before its result is merged (0: merged at once, the inner loop waits).
    fragment_alpha: α, on merge a fragment's parameters become (1 - α)·global + α·local
        (local: the replica's parameters after the τ overlapped steps); 0 takes the global.
        With α > 0 replicas differ by their last τ steps (the global parameters never do).
    """

    stages: int = 1
    activation_codec: str = "none"
    activation_grad_codec: str | None = None
    codec_overrides: tuple[tuple[str, str], ...] | None = None
    split_points: tuple[str, ...] | None = None
    balance: str = "flops"
    lowering: str = "inductor"
    fuse_codecs: bool = True
    data_parallel: bool = False
    gradient_codec: str = "none"
    bucket_mb: float = 25.0
    compress_min_numel: int = 1024
    min_compression_rate: float = 2.0
    warmup_steps: int = 0
    error_feedback: bool = False
    collective_timeout_s: float = 300.0
    broadcast_buffers: bool = True
    link_gbps: float | None = None
    link_latency_ms: float = 0.05
    link_shared: bool = False
    pipeline_schedule: str = "1F1B"
    microbatches: int = 8
    auto_loss_budget: float = 0.01
    auto_candidates: tuple[str, ...] | None = None
    auto_min_gain: float = 0.10
    objective: str = "step"
    steps_multipliers: str | None = None
    lazy_error_propagation: bool = False
    epilogue_only: bool = False
    gradient_codec_stages: tuple[int, ...] | None = None
    gradient_collective: str = "all_gather"
    sync_every: int | None = None
    outer_codec: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_collective: str = AUTO
    fragments: int = 1
    fragment_delay: int = 0
    fragment_alpha: float = 0.0
    collective_codec: str = "none"
    collective_overrides: tuple[tuple[str, str], ...] | None = None
    shard_bucket: str = "block"
    cluster: str | None = None
    placement: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ConfigError(f"stages must be an integer ≥ 1, got {self.stages!r}")
        if self.balance not in BALANCE:
            raise ConfigError(
                f"balance={self.balance!r} is not valid; choose one of {', '.join(BALANCE)}"
            )
        if self.lowering not in LOWERING:
            raise ConfigError(
                f"lowering={self.lowering!r} is not valid; choose one of {', '.join(LOWERING)}"
            )

        object.__setattr__(self, "activation_codec", _spec(self.activation_codec))
        if self.activation_grad_codec is not None:
            object.__setattr__(self, "activation_grad_codec", _spec(self.activation_grad_codec))
        self._check_data_parallel()
        self._check_local_steps()
        self._check_overrides()
        self._check_collectives()
        self._check_planner()
        self._check_objective()
        if self.split_points is not None:
            points = self.split_points
            if isinstance(points, str) or not all(isinstance(p, str) and p for p in points):
                raise ConfigError(
                    "split_points is a list of module qualified names such as ['layers.2'], "
                    f"got {points!r}"
                )
            points = tuple(points)
            object.__setattr__(self, "split_points", points)
            if self.stages == 1:
                object.__setattr__(self, "stages", len(points) + 1)
            elif self.stages != len(points) + 1:
                raise ConfigError(
                    f"{len(points)} split_points make {len(points) + 1} stages, but "
                    f"stages={self.stages}; drop `stages` or give {self.stages - 1} split points"
                )

    def _check_overrides(self) -> None:
        import re

        from . import codecs

        given = self.codec_overrides
        if given is None:
            return
        items = given.items() if isinstance(given, dict) else given
        out = []
        for key, value in items:
            where = re.fullmatch(r"\s*(edge|stage)\s+(\d+)\s*", str(key))
            if where is None:
                raise ConfigError(f"codec_overrides key {key!r}: write 'edge N' (the plan's edge "
                                  "N) or 'stage S' (every edge leaving stage S)")
            if not isinstance(value, str) or value.count("/") > 1:
                raise ConfigError(f"codec_overrides[{key!r}] = {value!r}: give a codec spec, or "
                                  "'forward/backward' such as 'none/powersgd:rank=16'")
            specs = "/".join(codecs.canonical_as_written(v) for v in value.split("/"))
            out.append((f"{where.group(1)} {int(where.group(2))}", specs))
        object.__setattr__(self, "codec_overrides", tuple(sorted(out)))

    def _check_collectives(self) -> None:
        import re

        from . import codecs

        def spec(value, where: str) -> str:
            if not isinstance(value, str):
                raise ConfigError(f"{where} = {value!r}: give a codec spec such as 'int8'")
            if value.strip().lower() == AUTO:
                return AUTO
            return codecs.canonical_as_written(value)

        object.__setattr__(self, "collective_codec",
                           spec(self.collective_codec, "collective_codec"))
        if self.shard_bucket not in SHARD_BUCKET:
            raise ConfigError(f"shard_bucket={self.shard_bucket!r} is not valid; choose one of "
                              f"{', '.join(map(repr, SHARD_BUCKET))} (one collective per block "
                              "of ccfx.shard's parameters, or one per parameter)")
        given = self.collective_overrides
        if given is None:
            return
        if isinstance(given, str) or not isinstance(given, (dict, tuple, list)):
            raise ConfigError("collective_overrides is a dict such as {'reduce_scatter': "
                              f"'int4:ef', 'collective 3': 'none'}}, got {given!r}")
        items = given.items() if isinstance(given, dict) else given
        out = []
        for key, value in items:
            key = str(key).strip()
            where = re.fullmatch(r"collective\s+(\d+)", key)
            if where is not None:
                key = f"collective {int(where.group(1))}"
            elif key not in COLLECTIVE_KINDS:
                raise ConfigError(
                    f"collective_overrides key {key!r}: write a kind ("
                    f"{', '.join(COLLECTIVE_KINDS)}) or 'collective N' (the plan's collective N)"
                    + closest(key, COLLECTIVE_KINDS))
            out.append((key, spec(value, f"collective_overrides[{key!r}]")))
        object.__setattr__(self, "collective_overrides", tuple(sorted(out)))

    def collective_spec(self, index: int, kind: str) -> tuple[str, str]:
        """(codec spec, the option that set it) of the plan's collective ``index`` of ``kind``:
        its ``collective_overrides`` entry by index, else by kind, else ``collective_codec``."""
        table = dict(self.collective_overrides or ())
        for key in (f"collective {index}", kind):
            if key in table:
                return table[key], f"collective_overrides[{key!r}]"
        return self.collective_codec, "collective_codec"

    def codecs_for(self, edge: int, source_stage: int) -> tuple[str, str]:
        """(forward, backward) codec specs of one cut edge: its ``codec_overrides`` entry, else
        its source stage's, else ``activation_codec`` / ``activation_grad_codec``."""
        table = dict(self.codec_overrides or ())
        value = table.get(f"edge {edge}", table.get(f"stage {source_stage}"))
        if value is None:
            return self.activation_codec, self.activation_grad_codec or self.activation_codec
        fwd, _, bwd = value.partition("/")
        return fwd, bwd or fwd

    def backward_spec(self, spec: str) -> str:
        """A backward cut codec as it runs: with error feedback under
        ``lazy_error_propagation``."""
        from . import codecs

        if not self.lazy_error_propagation or spec in ("none", AUTO) or spec.endswith("ef"):
            return spec
        return codecs.canonical(spec + (",ef" if ":" in spec else ":ef"))

    @property
    def uses_auto(self) -> bool:
        return (AUTO in (self.activation_codec, self.activation_grad_codec, self.gradient_codec,
                         self.collective_codec)
                or AUTO in dict(self.collective_overrides or ()).values())

    def _check_planner(self) -> None:
        from . import codecs

        if self.link_gbps is not None:
            if isinstance(self.link_gbps, bool) or not isinstance(self.link_gbps, (int, float)) \
                    or not self.link_gbps > 0:
                raise ConfigError(f"link_gbps is the link's bandwidth in Gbit/s (0.1 for "
                                  f"100 Mbit/s), a positive number; got {self.link_gbps!r}")
            object.__setattr__(self, "link_gbps", float(self.link_gbps))
        self._check_cluster()
        if self.uses_auto and self.link_gbps is None and self.cluster is None:
            raise ConfigError("'auto' codecs need the link they will run on: give link_gbps "
                              "(Gbit/s, e.g. 0.1 for 100 Mbit/s) and link_latency_ms, e.g. "
                              "options={'activation_codec': 'auto', 'link_gbps': 0.1}")
        for name in ("link_latency_ms", "auto_loss_budget", "auto_min_gain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a number ≥ 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("link_shared", "lazy_error_propagation", "epilogue_only"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} is True or False, got {getattr(self, name)!r}")
        if self.pipeline_schedule not in SCHEDULES:
            raise ConfigError(f"pipeline_schedule={self.pipeline_schedule!r}: the planner "
                              f"models {', '.join(SCHEDULES)}")
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"microbatches must be an integer ≥ 1, got {m!r}")
        if self.gradient_codec_stages is not None:
            st = self.gradient_codec_stages
            if isinstance(st, int) or not all(isinstance(x, int) and x >= 0 for x in st):
                raise ConfigError("gradient_codec_stages is a list of stage indices such as "
                                  f"[0, 1], got {st!r}")
            object.__setattr__(self, "gradient_codec_stages", tuple(sorted(set(st))))
        if self.auto_candidates is not None:
            given = self.auto_candidates
            if isinstance(given, str):
                given = (given,)
            object.__setattr__(self, "auto_candidates",
                               tuple(codecs.canonical(c) for c in given))

    def _check_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r} is not valid; choose one of "
                              f"{', '.join(OBJECTIVES)}" + closest(str(self.objective), OBJECTIVES))
        if self.steps_multipliers is not None:
            from .steps_table import canonical_json

            object.__setattr__(self, "steps_multipliers", canonical_json(self.steps_multipliers))

    def _check_data_parallel(self) -> None:
        from . import codecs

        for name in ("data_parallel", "error_feedback", "broadcast_buffers", "fuse_codecs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} is True or False, got {getattr(self, name)!r}")
        positive = {"bucket_mb": "a bucket's size cap in MiB, e.g. 25",
                    "min_compression_rate": "raw / wire bytes, e.g. 2.0",
                    "collective_timeout_s": "seconds, e.g. 300"}
        for name, what in positive.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number ({what}), got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("compress_min_numel", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer ≥ 0, got {value!r}")
        if isinstance(self.gradient_codec, str) and \
                self.gradient_codec.strip().lower().startswith("adaptive"):
            raise ConfigError(
                f"gradient_codec={self.gradient_codec!r}: adaptive compression switches codecs "
                "between steps, which a compiled backward cannot; it runs on DDP's comm hook: "
                "model.register_comm_hook(*ccfx.ddp_comm_hook('adaptive:light=...,heavy=...')) "
                "on a DDP model (docs/guides/frameworks.md). Here, give a fixed codec")
        spec = _spec(self.gradient_codec)
        if self.error_feedback and spec != AUTO and not spec.endswith("ef"):
            spec = codecs.canonical(spec + (",ef" if ":" in spec else ":ef"))
        object.__setattr__(self, "gradient_codec", spec)

    def _check_local_steps(self) -> None:
        for name in ("gradient_collective", "outer_collective"):
            if getattr(self, name) not in COLLECTIVES:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid; choose one of "
                                  f"{', '.join(COLLECTIVES)}")
        if not isinstance(self.outer_nesterov, bool):
            raise ConfigError(f"outer_nesterov is True or False, got {self.outer_nesterov!r}")
        for name, low in (("fragments", 1), ("fragment_delay", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer ≥ {low}, got {value!r}")
        for name in ("outer_lr", "outer_momentum", "fragment_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a number ≥ 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.fragment_alpha > 1 or self.outer_momentum >= 1:
            raise ConfigError("fragment_alpha is in [0, 1] and outer_momentum in [0, 1), got "
                              f"{self.fragment_alpha} and {self.outer_momentum}")
        from . import codecs

        object.__setattr__(self, "outer_codec", codecs.canonical_as_written(self.outer_codec))
        h = self.sync_every
        if h is None:
            return
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ConfigError(f"sync_every must be an integer ≥ 1 (inner steps between syncs) "
                              f"or None, got {h!r}")
        if self.data_parallel:
            raise ConfigError(
                "data_parallel=True averages gradients at every step and sync_every averages "
                "parameters every H steps: choose one (sync_every=1 with outer_lr=1 and "
                "outer_momentum=0 is per-step data parallel)")
        if self.fragments > h:
            raise ConfigError(f"fragments={self.fragments} > sync_every={h}: each fragment "
                              "syncs once every sync_every steps, at most one per step")
        if self.fragment_delay >= max(1, h // self.fragments) and self.fragment_delay:
            raise ConfigError(
                f"fragment_delay={self.fragment_delay} must be < sync_every // fragments = "
                f"{h // self.fragments}: a fragment's sync must be merged before the next "
                "fragment's starts")

    def _check_cluster(self) -> None:
        import json

        given = self.cluster
        if given is None:
            self._check_placement(None)
            return
        from .cluster_files import from_dict, read, to_dict

        if isinstance(given, dict):
            cluster = from_dict(given)
        elif isinstance(given, str) and given.lstrip().startswith("{"):
            try:
                cluster = from_dict(json.loads(given))
            except json.JSONDecodeError as e:
                raise ConfigError(f"cluster: {e}; give a file path or a dict") from None
        elif isinstance(given, str):
            cluster = read(given)
        else:
            raise ConfigError(f"cluster = {given!r}: give the path of a .toml or .json cluster "
                              "file, or a dict such as ccfx.Cluster.nodes(...).to_dict()")
        object.__setattr__(self, "cluster",
                           json.dumps(to_dict(cluster), sort_keys=True, separators=(",", ":")))
        self._check_placement(cluster)

    def _check_placement(self, cluster=None) -> None:
        """``placement``: one distinct device of ``cluster`` per rank, kept as indices."""
        given = self.placement
        if given is None:
            return
        if cluster is None:
            raise ConfigError("placement maps ranks to the devices of a cluster: give the "
                              "cluster option too (a ccfx.Cluster's file or dict)")
        if isinstance(given, (str, int)) or not isinstance(given, (list, tuple)) or not given:
            raise ConfigError(f"placement = {given!r}: give a list with a device (name or "
                              "index in the cluster) per rank, e.g. ['n0.d0', 'n1.d0']")
        out = []
        for r, device in enumerate(given):
            try:
                out.append(cluster.index(device))
            except ConfigError as e:
                raise ConfigError(f"placement[{r}]: {e}") from None
        if len(set(out)) != len(out):
            twice = next(d for d in out if out.count(d) > 1)
            raise ConfigError(f"placement puts two ranks on device {cluster.names[twice]!r}: "
                              "give every rank its own device")
        object.__setattr__(self, "placement", tuple(out))

    def cluster_description(self):
        """The ``cluster`` option's devices and links, a :class:`~ccfx.cluster_spec.ClusterSpec`
        (None without one); ``ccfx.Cluster.from_dict(json.loads(config.cluster))`` adds the
        measured rate, the probe and the dict and file forms."""
        import json

        if self.cluster is None:
            return None
        from .cluster_files import from_dict

        return from_dict(json.loads(self.cluster))

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> Config:
        """Build from a ``torch.compile(options=...)`` dict; unknown keys are an error."""
        if options is None:
            return cls()
        if isinstance(options, Config):
            return options
        if not isinstance(options, dict):
            raise ConfigError(f"options must be a dict of ccfx options, got {type(options).__name__}")
        return cls(**options)  # unknown keys: ConfigError from _refuse_unknown_keys

    @classmethod
    def resolve(cls, options: dict[str, Any] | Config | None,
                environ: dict[str, str] | None = None) -> tuple[Config, dict[str, str]]:
        """The Config for one compile and where each option came from ("default",
        "environment" for ``$CCFX_OPTIONS``, "options" for torch.compile's dict): explicit
        options win over the environment, which wins over the defaults."""
        import json
        import os

        if isinstance(options, Config):
            return options, dict.fromkeys(cls.keys(), "Config")
        environ = os.environ if environ is None else environ
        merged: dict[str, Any] = {}
        names = cls.keys()
        sources = dict.fromkeys(names, "default")
        text = environ.get(OPTIONS_ENV, "").strip()
        if text:
            try:
                from_env = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"${OPTIONS_ENV} must be a JSON object of ccfx options such "
                                  f'as {{"data_parallel": true}}; it does not parse: {e}') from None
            if not isinstance(from_env, dict):
                raise ConfigError(f"${OPTIONS_ENV} must be a JSON object, got {text!r}")
            merged.update(from_env)
            sources.update({k: "environment" for k in from_env})
        if options:
            if not isinstance(options, dict):
                raise ConfigError(
                    f"options must be a dict of ccfx options, got {type(options).__name__}")
            merged.update(options)
            sources.update({k: "options" for k in options})
        try:
            config = cls.from_options(merged or None)
        except ConfigError as e:
            raise ConfigError(f"{_blame(cls, from_env if text else None, options)}: {e}") from None
        return config, {k: v for k, v in sources.items() if k in names}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["split_points"] is not None:
            d["split_points"] = list(d["split_points"])
        for key in ("codec_overrides", "collective_overrides"):
            if d[key] is not None:
                d[key] = dict(d[key])
        for key in ("auto_candidates", "gradient_codec_stages", "placement"):
            if d[key] is not None:
                d[key] = list(d[key])
        if d["cluster"] is not None:
            import json

            d["cluster"] = json.loads(d["cluster"])
        if d["steps_multipliers"] is not None:
            import json

            d["steps_multipliers"] = json.loads(d["steps_multipliers"])
        return d

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)




def _refuse_unknown_keys(init):
    """Config's dataclass ``__init__`` (and so ``replace``) raising ConfigError, not TypeError,
    for a misspelled option: ``ccfx.Config(stagez=4)`` reads as ``options={"stagez": 4}``."""
    import functools

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        names = Config.keys()
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown ccfx option(s) {', '.join(map(repr, unknown))}"
                + "".join(closest(str(u), names) for u in unknown)
                + f"; valid options: {', '.join(names)}"
            )
        init(self, *args, **kwargs)

    return __init__


Config.__init__ = _refuse_unknown_keys(Config.__init__)


def closest(name: str, valid) -> str:
    """" (did you mean 'x'?)" for the valid name nearest ``name`` (difflib), else ""."""
    import difflib

    near = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _blame(cls, from_env: dict | None, options: dict | None) -> str:
    """Where a bad option came from: ``$CCFX_OPTIONS``, the compile call's options, or the two
    together (each valid alone)."""
    env_call = f"${OPTIONS_ENV}"
    call = "torch.compile(options=...)"
    if not from_env:
        return call
    if not options:
        return env_call
    for where, given in ((env_call, from_env), (call, options)):
        try:
            cls.from_options(given)
        except ConfigError:
            return where
    return f"{env_call} together with {call}"


def _spec(spec: str) -> str:
    """A codec option's canonical spec; ``"auto"`` stays as it is."""
    from . import codecs

    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        return AUTO
    return codecs.canonical_as_written(spec)
