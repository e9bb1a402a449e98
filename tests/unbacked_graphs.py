"""Graphs with data-dependent (unbacked) split sizes, as Dynamo hands them to a backend under
``capture_scalar_outputs``: what tests/test_wire_collectives.py and tests/test_moe_all_to_all.py
trace their expert all-to-alls from (single process, fake tensors, no process group)."""

from __future__ import annotations

import torch


def traced_with_unbacked_sizes(fn, *args):
    """``fn`` traced as Dynamo hands a ``capture_scalar_outputs`` graph to a backend: fake
    tensors of static shapes, ``.tolist()`` giving unbacked SymInts (u0, u1...)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return make_fx(fn, tracing_mode="fake")(*(mode.from_tensor(a, static_shapes=True)
                                              for a in args))


def unbacked_rows(x: torch.Tensor, counts: torch.Tensor):
    """Inside a traced function: ``counts`` (two of them) read with ``.tolist()`` as unbacked
    sizes ``a`` and ``b``, with the checks that bound them (a router's counts: at least 0, at
    most ``x``'s rows together), and the first ``a + b`` rows of ``x``: ``(rows, a, b)``."""
    a, b = counts.tolist()
    torch._check(a >= 0)
    torch._check(b >= 0)
    torch._check(a + b <= x.shape[0])
    return x[:a + b], a, b
