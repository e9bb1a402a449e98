"""ccfx's graph passes: GraphModule in, GraphModule out, facts in ``node.meta["ccfx"]``.

See passes/README.md for the invariants every pass keeps.
"""

from .annotate import annotate
from .cut_edges import cut_edges
from .infra import PassError, run_passes
from .partition import partition

__all__ = ["PassError", "annotate", "cut_edges", "partition", "run_passes"]
