"""What a pipeline rank does to its stages' gradients after ``schedule.step()``:
``ccfx.sync_grads(stages)``, before ``optimizer.step()``.

1. **Tied parameters** (a tied embedding and LM head: the first and the last stage read one
   weight) have a partial gradient on each rank that holds them: one all-reduce (sum) per
   parameter over the ranks that hold it, on a group made with
   ``use_local_synchronization`` (only those ranks take part).
2. **Data parallel** (PP × DP, ``build_stages(..., dp_group=...)``): the rank's stage
   gradients are averaged over its data-parallel group (the ranks that run the same stages in
   the other replicas) in buckets, through ``gradient_codec``, by the same bucket exchanges the
   compiled data-parallel path and the DDP comm hook run (:mod:`ccfx.wire.exchange`): the same
   bucket policy (``bucket_mb``, ``compress_min_numel``, ``min_compression_rate``), PowerSGD
   with its warm start and error feedback, ``gradient_collective`` (all-gather or ring).
   Tied parameters travel uncompressed, so their
   copies on two ranks stay equal. The exchanges run after the step, eagerly: they do not
   overlap the last microbatch's backward (torch's schedules give no hook between a stage's
   last backward and the end of the step that every schedule calls).

The buckets' codec state is registered in the codec state of the rank's first stage module,
as ``ccfx_codec_state.graph<g>.stage<s>.bucket<b>.<state-name>`` (:mod:`ccfx.codecs.state`), so
a checkpoint of the stage's ``state_dict()`` holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs.state import bucket_channel, state_of
from ..errors import CollectiveError, ConfigError
from ..wire.comm import ProcessGroupComm
from ..wire.exchange import BucketLayout, exchange_for
from ..wire.link import Link, configured_link, resolve_collective
from ..wire.policy import GradSlot, assign_buckets


class StageGradSync:
    """One rank's gradient synchronization for its stages (see the module docstring)."""

    def __init__(self, stages: Sequence, config, dp_group=None, ledger=None, graph: int = 0,
                 codec: str | None = None, link: Link | None = None):
        """``codec``: these stages' gradient codec (default ``config.gradient_codec``; selective
        stage compression gives each stage its own). ``link``: what
        ``gradient_collective="auto"`` is priced on, the backend's decision for ``dp_group``
        (with ``cluster``, the group's slowest link); default the ``link_gbps`` link."""
        self.link = link if link is not None else configured_link(config)
        self.stages = list(stages)
        self.config = config
        self.codec = codec or config.gradient_codec
        self.dp_group = dp_group
        self.ledger = ledger
        self.graph = graph
        self.params: dict[str, torch.nn.Parameter] = {}
        for st in self.stages:
            for name, p in st.submod.named_parameters(remove_duplicate=False):
                self.params.setdefault(name, p)
        self.shared: dict[str, dist.ProcessGroup] = {
            name: pg for st in self.stages for name, (pg, _) in st.shared.items()}
        self.buckets = []
        # Local steps (sync_every) average parameters every H steps instead: no per-step buckets.
        if (dp_group is not None and dist.get_world_size(dp_group) > 1
                and config.sync_every is None):
            self._plan_buckets(config)
            from ..wire import agree

            agree.publish_process()  # a replica's failure can then be named by rank

    def _plan_buckets(self, config) -> None:
        names = list(self.params)
        # Backward makes the last stage's, last layer's gradients first.
        slots = [GradSlot(k, k, name, tuple(self.params[name].shape), self.params[name].dtype,
                          len(names) - k) for k, name in enumerate(names)]
        tied = [s for s in slots if s.name in self.shared]
        rest = [s for s in slots if s.name not in self.shared]
        plan = assign_buckets(rest, self.codec, config.bucket_mb,
                              config.compress_min_numel, config.min_compression_rate)
        if tied:
            plan += assign_buckets(tied, "none", config.bucket_mb, 0, 1.0)
        device = next(iter(self.params.values())).device
        first = self.stages[0]
        for i, b in enumerate(plan):
            layout = BucketLayout(tuple(s.shape for s in b.slots), b.slots[0].dtype)
            exchange = exchange_for(layout, b.spec, self._collective(config, b.spec, layout))
            tensors = exchange.init_state(device)
            if tensors:
                tensors = state_of(first.submod).add(
                    bucket_channel(self.graph, i, first.stage_index), b.spec, tensors,
                    legacy=f"ccfx_grad_state.bucket{i}_")
            self.buckets.append((i, [s.name for s in b.slots], exchange, tensors))

    def _collective(self, config, spec: str, layout: BucketLayout) -> str:
        """``gradient_collective``, "auto" resolved by cost over this data-parallel group on
        the backend's link for it (the same arguments on every replica, so the same answer)."""
        return resolve_collective(config.gradient_collective, spec, layout.numel, layout.dtype,
                                  dist.get_world_size(self.dp_group), self.link)

    def __call__(self) -> None:
        for name in sorted(self.shared):
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.shared[name])
        for st in self.stages:
            st._unsynced = False
        if not self.buckets:
            return
        comm = ProcessGroupComm(self.dp_group)
        for index, names, exchange, tensors in self.buckets:
            grads = []
            for n in names:
                p = self.params[n]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            try:
                averaged = exchange.run(grads, tensors, comm)
            except RuntimeError as e:
                raise self._failed(index, exchange, e) from e
            for g, a in zip(grads, averaged, strict=True):
                g.copy_(a)
            del averaged  # not held while the next bucket's exchange runs
            if self.ledger is not None:
                self.ledger.record_bucket(self.graph, index, exchange.raw_bytes,
                                          exchange.sent_bytes())


    def _failed(self, index: int, exchange, e: RuntimeError) -> CollectiveError:
        """A failed bucket exchange over the replicas (a dead, hung or diverged replica:
        gloo's error, within ``dp_group``'s own timeout) as a CollectiveError naming this rank,
        its stages, the bucket and the replica rank gloo's address points at."""
        from ..wire import agree

        stages = ", ".join(str(st.stage_index) for st in self.stages)
        what = (f"the data-parallel exchange of stage {stages}'s bucket {index} "
                f"({exchange.spec} via {exchange.collective}) over the replicas")
        first, who = agree.failed(what, e, agree.world_ranks(self.dp_group))
        return CollectiveError(
            f"rank {dist.get_rank()} (replica {dist.get_rank(self.dp_group)} of "
            f"{dist.get_world_size(self.dp_group)}): ccfx.sync_grads: {what} failed: {first}."
            f"{who} A replica died, hung past dp_group's timeout, or ran a different step; see "
            "that rank's own error.")


def sync_grads(stages: Sequence) -> None:
    """Run the gradient synchronization of a rank's stages (see the module docstring)."""
    if not stages:
        raise ConfigError("sync_grads needs this rank's stages (the list build_stages returned)")
    sync = getattr(stages[0], "grad_sync", None)
    if sync is None:
        raise ConfigError("these stages were not built by ccfx.build_stages()")
    sync()
