"""What the layout search returns: the chosen layout, its runners-up and the refused ones,
the explanation (MAD-Max's breakdown: compute, exposed communication by kind, bubble,
memory) and the options that run the chosen layout with ccfx today."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..steps_table import SOURCE as STEPS_SOURCE
from .cluster import Cluster
from .layout import Layout, LayoutPrediction, steps_multiplier
from .memory_model import MEMORY_LIMIT
from .model_facts import ModelFacts

GIB = 2 ** 30


@dataclass
class ParallelPlan:
    """``ranked``: the layouts that fit, fastest first; ``refused``: those above
    :data:`~ccfx.planner.memory_model.MEMORY_LIMIT` of a device's memory, with the reason;
    ``skipped``: degrees not priced at all, and why; ``pruned``: layouts not simulated, their
    step's lower bound above the ``top`` fastest (3 refused) found (memory exact, no step)."""

    ranked: list[LayoutPrediction]
    refused: list[LayoutPrediction]
    skipped: list[str]
    facts: ModelFacts
    cluster: Cluster
    top: int = 5
    search_s: float = 0.0
    target_steps: int | None = None
    notes: list[str] = field(default_factory=list)
    pruned: list[LayoutPrediction] = field(default_factory=list)

    def __post_init__(self):
        if not self.ranked and not self.refused:  # nothing priced: say why, not memory
            raise ConfigError(
                f"plan_parallel: no layout could be priced on {len(self.cluster.devices)} "
                f"devices, every degree was skipped: {'; '.join(self.skipped)}. The example "
                "inputs are the whole step's batch: give one that splits over the replicas "
                "(at least as many samples as devices), or describe fewer devices")
        if not self.ranked:
            closest = min(self.refused + self.pruned, key=lambda p: p.peak_memory_bytes,
                          default=None)
            why = (f"; the smallest, {closest.layout.describe()}: {closest.refused}"
                   if closest else "")
            raise ConfigError(
                f"plan_parallel: no layout fits: {len(self.refused)} priced, every one above "
                f"{MEMORY_LIMIT:.0%} of a device's memory{why}. Use devices with more memory, "
                "a smaller batch (fewer activations per microbatch), a smaller model, or "
                "tensor parallelism (declare the model's TP plan)")

    # -- the chosen layout ------------------------------------------------------------------

    @property
    def chosen(self) -> LayoutPrediction:
        return self.ranked[0]

    @property
    def layout(self) -> Layout:
        return self.chosen.layout

    @property
    def predicted_step_s(self) -> float:
        return self.chosen.step_s

    @property
    def peak_memory_bytes(self) -> int:
        """The chosen layout's largest per-device estimate."""
        return self.chosen.peak_memory_bytes

    @property
    def placement(self) -> tuple[str, ...]:
        """The device of each rank."""
        return self.layout.placement(self.cluster)

    @property
    def steps_multiplier(self) -> float:
        """The chosen hop codecs' steps multiplier (:func:`~ccfx.planner.layout.
        steps_multiplier`)."""
        return steps_multiplier(self.layout)

    @property
    def time_to_target_s(self) -> float | None:
        """``target_steps`` (the uncompressed run's) × the steps multiplier × the predicted
        step: what the search ranks by when a target is given."""
        if self.target_steps is None:
            return None
        return self.target_steps * self.steps_multiplier * self.predicted_step_s

    def role(self, rank: int) -> dict:
        """Where ``rank`` sits: its stage, replica, tensor-parallel lane and device."""
        self._check_rank(rank)
        s, d, t = self.layout.coords(rank)
        lo, hi = self.layout.stage_layers(self.facts.num_layers)[s]
        return {"stage": s, "replica": d, "tp_lane": t, "device": self.placement[rank],
                "layers": (self.facts.layers[lo].name, self.facts.layers[hi - 1].name)}

    def options(self, rank: int | None = None) -> dict:
        """The ``torch.compile(..., backend="ccfx", options=...)`` that run the chosen layout:
        the same on every rank (ranks compare a fingerprint of their options), so ``rank``
        only checks the range; :meth:`role` says what each rank runs. ``cluster`` and
        ``placement`` (each rank's device; ranks as a ``(dp, pp)`` DeviceMesh numbers them)
        let ``auto`` and ``collective_codec="auto"`` price each hop, bucket and collective on
        its own link; ``link_gbps`` is the slowest link the layout uses. Compile at the
        microbatch shape (the traced batch / (dp × microbatches)). Sharded data parallel is
        ``ccfx.shard(model, ...)`` before compiling, tensor parallel the model's own TP plan
        (``parallelize_module``) on a ``(dp, pp, tp)`` mesh: ccfx compresses their
        collectives (``collective_codec="auto"`` on the placed cluster)."""
        if rank is not None:
            self._check_rank(rank)
        lay = self.layout
        opts: dict = {"stages": lay.pp}
        if lay.pp > 1:
            opts["split_points"] = tuple(self.facts.layers[b].name for b in lay.boundaries[1:])
            opts["microbatches"] = lay.microbatches
            opts["pipeline_schedule"] = lay.schedule
            codecs = set(lay.hop_codecs)
            if len(codecs) == 1:
                fwd, bwd = next(iter(codecs))
                opts["activation_codec"] = fwd
                opts["activation_grad_codec"] = bwd
            else:
                opts["codec_overrides"] = {f"stage {s}": f"{f}/{b}"
                                           for s, (f, b) in enumerate(lay.hop_codecs)}
        if lay.dp > 1 and lay.sync_every:
            opts["sync_every"] = lay.sync_every
            opts["outer_codec"] = lay.outer_codec
        elif lay.dp > 1 and not lay.sharded:
            opts["data_parallel"] = True
            compressed = {c for c in lay.gradient_codecs if c != "none"}
            if compressed:
                spec = min(compressed)
                opts["gradient_codec"] = spec
                stages = tuple(s for s, c in enumerate(lay.gradient_codecs) if c == spec)
                if lay.pp > 1 and len(stages) < lay.pp:
                    opts["gradient_codec_stages"] = stages
        if lay.tp > 1 or lay.sharded:
            opts["collective_codec"] = "auto"
        if self.cluster.world > 1:
            opts["cluster"] = self.cluster.to_dict()
            opts["placement"] = self.placement
            slowest = min((x for x in (*self.chosen.hop_links, *self.chosen.dp_links)
                           if x is not None), key=lambda x: x.gbps, default=None)
            if slowest is not None:
                opts["link_gbps"] = slowest.gbps
                opts["link_latency_ms"] = slowest.latency_ms
        return opts

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not \
                0 <= rank < self.layout.world:
            raise ConfigError(f"plan_parallel: rank {rank!r} is not one of the layout's "
                              f"{self.layout.world} ranks (0 … {self.layout.world - 1})")

    # -- the explanation --------------------------------------------------------------------

    def explain(self) -> str:
        f, c = self.facts, self.cluster
        nodes = c.by_node()
        lines = [
            (f"plan_parallel: {f.num_layers} layers, {f.param_numel / 1e9:.3g} B parameters, "
             f"batch {f.batch} per step, {3 * f.flops / 1e12:.4g} TFLOP per step (forward + "
             f"backward); {c.world} devices in {len(nodes)} node(s)"),
            (f"  searched {len(self.ranked) + len(self.refused) + len(self.pruned)} layouts"
             f" in {self.search_s:.2f} s: {len(self.ranked)} fit, {len(self.refused)} refused "
             f"(memory above {MEMORY_LIMIT:.0%}), {len(self.pruned)} pruned (their step's "
             f"lower bound above the {self.top} fastest), {len(self.skipped)} degree(s) "
             "skipped"),
        ]
        best = self.chosen
        lines.append(f"chosen: {best.layout.describe()}: {self._line(best)}")
        lines.extend("  " + x for x in self._detail(best))
        if self.time_to_target_s is not None:
            lines.append(f"  time to target: {self.target_steps} steps x "
                         f"{self.steps_multiplier:.3g} (the hop codecs' steps multiplier, "
                         f"{STEPS_SOURCE}) x {best.step_s:.4g} s = "
                         f"{self.time_to_target_s / 3600:.3g} h; ranked by it")
        runners = self.ranked[1:self.top]
        if runners:
            lines.append("runners-up:")
            for i, p in enumerate(runners, 2):
                slower = p.step_s / best.step_s - 1
                lines.append(f"  {i}. {p.layout.describe()}: {self._line(p)} "
                             f"(+{slower:.1%})")
        if self.refused:
            lines.append(f"refused ({len(self.refused)}; the {min(3, len(self.refused))} "
                         "fastest):")
            for p in self.refused[:3]:
                lines.append(f"  {p.layout.describe()}: {p.step_s:.4g} s, but {p.refused}")
        for s in self.skipped[:3]:
            lines.append(f"skipped: {s}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _line(self, p: LayoutPrediction) -> str:
        peak = max(range(len(p.memory)), key=lambda s: p.memory[s].total)
        return (f"step {p.step_s:.4g} s = {p.breakdown()}; peak "
                f"{p.memory[peak].total / GIB:.3g} GiB of {p.device_memory[peak] / GIB:.3g} "
                f"(stage {peak})")

    def _detail(self, p: LayoutPrediction) -> list[str]:
        lay, out = p.layout, []
        where = lay.placement(self.cluster)
        for s, (lo, hi) in enumerate(lay.stage_layers(self.facts.num_layers)):
            devs = [where[lay.rank(s, d, t)] for d in range(lay.dp) for t in range(lay.tp)]
            shown = ", ".join(devs[:4]) + (f", … ({len(devs)})" if len(devs) > 4 else "")
            text = (f"stage {s}: {self.facts.layers[lo].name} … {self.facts.layers[hi - 1].name}"
                    f" on {shown}; memory {p.memory[s].describe()}")
            if s < len(p.dp_links) and p.dp_links[s] is not None:
                spec = (lay.gradient_codecs[s] if s < len(lay.gradient_codecs) else "none")
                how = (f"sync every {lay.sync_every} ({lay.outer_codec})" if lay.sync_every
                       else "sharded" if lay.sharded else spec)
                on = p.dp_text[s] if s < len(p.dp_text) and p.dp_text[s] else \
                    _link(p.dp_links[s])
                text += f"; dp group on {on}: {how}"
            out.append(text)
            if s < len(p.hop_links):
                fwd, bwd = lay.hop_codecs[s] if s < len(lay.hop_codecs) else ("none", "none")
                on = p.hop_text[s] if s < len(p.hop_text) else _link(p.hop_links[s])
                out.append(f"  hop {s}->{s + 1} on {on}: forward {fwd}, backward {bwd}")
        for s, link in enumerate(p.tp_links):
            if link is not None:
                out.append(f"tp groups of stage {s} on {_link(link)}")
                out.append(_sequence_parallel_text(lay))
                break
        if lay.recompute in RECOMPUTE_TEXT:
            out.append(RECOMPUTE_TEXT[lay.recompute])
        out.extend(p.notes)
        return out


#: what the user does for each recomputation policy the search may choose
RECOMPUTE_TEXT = {
    "block": ("recompute each block: wrap every block in torch.utils.checkpoint (ccfx "
              "compiles checkpointed regions); its backward runs its forward again, and a "
              "microbatch keeps only the blocks' inputs"),
    "selective": ("recompute the attention core (Megatron-LM's selective recomputation, "
                  "--recompute-granularity selective): wrap each block's attention core (the "
                  "scores, softmax, dropout and their product with V, or its "
                  "scaled_dot_product_attention call) in torch.utils.checkpoint, or "
                  "checkpoint the block with torch.utils.checkpoint.checkpoint(..., "
                  "context_fn=partial(create_selective_checkpoint_contexts, policy)) where "
                  "policy returns CheckpointPolicy.MUST_RECOMPUTE for those ops and MUST_SAVE "
                  "for the rest (torchtitan's op-level selective mode saves attention "
                  "instead); its backward runs the core's forward again, and a microbatch "
                  "keeps everything else"),
}


def _sequence_parallel_text(lay: Layout) -> str:
    """How tensor parallelism runs, as the layout's memory was priced."""
    if lay.sequence_parallel:
        return ("tensor parallel with sequence parallelism (priced so): the model's TP plan "
                "plus torch's SequenceParallel on the norms and dropouts, the column-parallel "
                "linears' inputs and row-parallel linears' outputs Shard(1) "
                "(torch.distributed.tensor.parallel), as Megatron-LM's "
                "--sequence-parallel")
    return ("tensor parallel without sequence parallelism (priced so): the norms' and "
            "residuals' activations whole on every TP rank")


def _link(link) -> str:
    return f"{link.gbps:g} Gbit/s {link.latency_ms:g} ms"
