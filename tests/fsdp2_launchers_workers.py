"""What each rank runs in ``test_fsdp2_launchers``'s Accelerate test: ``examples/accelerate_fsdp2.py``
with accelerate's FSDP path taken on CPU.

    torchrun --nproc-per-node 2 tests/fsdp2_launchers_workers.py [example args]

accelerate takes its FSDP path only for accelerator devices: ``AcceleratorState`` sets
``DistributedType.FSDP`` in its branch for ``MULTI_GPU``, ``MULTI_XPU``, ... and never for
``MULTI_CPU`` (accelerate 1.16, ``accelerate/state.py``), and ``accelerate launch`` refuses
``--cpu`` with ``--use_fsdp``. So here, and only here, the state is switched to FSDP after
accelerate built it for CPU, exactly as it is on GPUs; everything after that is accelerate's
own: ``prepare`` runs ``fsdp2_prepare_model`` (its auto-wrap policy, ``fully_shard`` on the
default CPU mesh), then the example registers ccfx's codecs on what it returned and trains.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "accelerate_fsdp2.py"


def take_fsdp_path_on_cpu() -> None:
    """Make an ``AcceleratorState`` built for CPU with an FSDP plugin use that plugin, as the
    same state built for GPUs does."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    built = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        built(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


if __name__ == "__main__":
    take_fsdp_path_on_cpu()
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
