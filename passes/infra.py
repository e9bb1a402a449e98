"""A small pass runner in the manner of torch.fx.passes.infra.pass_manager.

Each pass is a function GraphModule → GraphModule. After each one the runner lints the graph
and recompiles it; a failure is re-raised as :class:`PassError` naming the pass that failed and
the ones that ran before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx

from ccfx.errors import CcfxError

Pass = Callable[[torch.fx.GraphModule], torch.fx.GraphModule]


class PassError(CcfxError):
    pass


def pass_name(p: Pass) -> str:
    func = getattr(p, "func", p)  # functools.partial
    return getattr(func, "__name__", type(func).__name__)


def run_passes(gm: torch.fx.GraphModule, passes: Sequence[Pass]) -> torch.fx.GraphModule:
    done: list[str] = []
    for p in passes:
        name = pass_name(p)
        try:
            out = p(gm)
            gm = gm if out is None else out
            gm.graph.lint()
            gm.recompile()
        except CcfxError as e:
            if isinstance(e, PassError):
                raise
            raise type(e)(f"{e}\n(in ccfx pass {name!r}, after {done or 'no passes'})") from e
        except Exception as e:
            raise PassError(
                f"ccfx pass {name!r} failed after passes {done or '[]'}: "
                f"{type(e).__name__}: {e}"
            ) from e
        done.append(name)
    return gm
