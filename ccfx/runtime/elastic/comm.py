"""The exchanges' ``Comm`` on the process group torchft rebuilds at every quorum."""

from __future__ import annotations

import torch

from ...errors import ConfigError


class TorchftComm:
    """The exchanges' ``Comm`` (:mod:`ccfx.wire.comm`) on a torchft process group: its size is
    the current quorum's. gloo's torchft group has no reduce-scatter, and point to point (the
    ring) is not offered on a group that is rebuilt at every quorum change."""

    def __init__(self, pg):
        self.pg = pg
        self.world = pg.size()
        self.rank = pg.parent.rank()  # this replica's place in the quorum (its chunk)

    def all_reduce(self, t):
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        out = t.detach().clone(memory_format=torch.contiguous_format)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return self.pg.allreduce([out], opts), lambda: out

    def all_gather(self, t):
        from torch.distributed.distributed_c10d import AllgatherOptions

        flat = t.detach().reshape(-1).contiguous()
        outs = [torch.empty_like(flat) for _ in range(self.world)]
        return self.pg.allgather([outs], [flat], AllgatherOptions()), lambda: torch.cat(outs)

    def all_to_all(self, t, output_splits=None, input_splits=None):
        from torch.distributed.distributed_c10d import AllToAllOptions

        inp = t.detach().contiguous()
        out = torch.empty_like(inp) if output_splits is None else inp.new_empty(
            (sum(output_splits), *inp.shape[1:]))
        work = self.pg.alltoall_base(out, inp, list(output_splits or []),
                                     list(input_splits or []), AllToAllOptions())
        return work, lambda: out

    def reduce_scatter(self, t):
        raise ConfigError("torchft's gloo process group has no reduce-scatter")

    def ring(self, flat, spec, state):
        raise ConfigError("outer_collective='ring' is not supported with fault_tolerant=True")

    def wait(self, handle):
        work, result = handle
        work.wait()
        return result()
