"""Per-node cost: FLOPs and output bytes, as sympy expressions.

Sizes come from the node's fake tensor (``meta["val"]``); under ``torch.compile(dynamic=True)``
they are SymInts, which become sympy symbols here, so a cost such as ``2*s0*4096*4096`` stays
symbolic and is evaluated at the example shapes only when a number is needed.

FLOPs count multiply-adds as two. Matmul-like ops and convolutions are counted exactly;
elementwise ops and reductions cost one FLOP per output element; views, reshapes and
bookkeeping cost nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx

from ccfx import _torch_compat as tc

ZERO = sympy.Integer(0)

#: Ops that move no data or only reinterpret it.
FREE = {
    "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand", "squeeze",
    "unsqueeze", "flatten", "unflatten", "getitem", "size", "stride", "dim", "split", "chunk",
    "unbind", "contiguous", "alias", "detach", "as_strided", "narrow", "select", "slice",
    "view_as", "expand_as", "numel", "sym_size", "sym_numel", "sym_stride", "type_as", "to",
    "float", "clone", "getattr", "lift_fresh_copy", "_to_copy",
}


def sym(value) -> sympy.Expr:
    """An int or SymInt as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def shape_of(t: torch.Tensor) -> tuple[sympy.Expr, ...]:
    return tuple(sym(d) for d in t.shape)


def numel(t: torch.Tensor) -> sympy.Expr:
    n = sympy.Integer(1)
    for d in shape_of(t):
        n = n * d
    return n


def nbytes(t: torch.Tensor) -> sympy.Expr:
    return numel(t) * t.dtype.itemsize


def op_name(node: torch.fx.Node) -> str:
    """A short, stable name for the node's operation, at torch or aten level."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, tc.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, tc.OpOverloadPacket):
        return target.__name__
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def _val(arg) -> Any:
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    return arg


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _matmul_flops(node, out: torch.Tensor) -> sympy.Expr:
    a = _val(node.args[0])
    k = shape_of(a)[-1] if isinstance(a, torch.Tensor) and a.dim() else sympy.Integer(1)
    return 2 * numel(out) * k


def _addmm_flops(node, out):
    a = _val(node.args[1])
    return 2 * numel(out) * shape_of(a)[-1]


def _conv_flops(node, out):
    w = _val(node.args[1])
    ws = shape_of(w)  # (C_out, C_in / groups, *kernel)
    per_out = sympy.Integer(1)
    for d in ws[1:]:
        per_out *= d
    return 2 * numel(out) * per_out


def _sdpa_flops(node, out):
    q, k = _val(node.args[0]), _val(node.args[1])
    qs, ks = shape_of(q), shape_of(k)
    batch = sympy.Integer(1)
    for d in qs[:-2]:
        batch *= d
    return 4 * batch * qs[-2] * ks[-2] * qs[-1]


FLOP_RULES = {
    "linear": _matmul_flops, "matmul": _matmul_flops, "mm": _matmul_flops, "bmm": _matmul_flops,
    "__matmul__": _matmul_flops, "addmm": _addmm_flops, "baddbmm": _addmm_flops,
    "conv1d": _conv_flops, "conv2d": _conv_flops, "conv3d": _conv_flops,
    "convolution": _conv_flops, "conv_transpose2d": _conv_flops,
    "scaled_dot_product_attention": _sdpa_flops,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_flops,
    "_scaled_dot_product_efficient_attention": _sdpa_flops,
}


def node_flops(node: torch.fx.Node) -> sympy.Expr:
    if node.op not in ("call_function", "call_method", "call_module"):
        return ZERO
    name = op_name(node)
    outs = _tensors(_val(node))
    if not outs or name in FREE:
        return ZERO
    rule = FLOP_RULES.get(name)
    if rule is not None:
        try:
            return rule(node, outs[0])
        except (IndexError, TypeError, AttributeError):
            pass  # unusual call form: fall back to one FLOP per element
    return sum((numel(t) for t in outs), ZERO)


def node_bytes(node: torch.fx.Node) -> sympy.Expr:
    """Bytes of the node's output tensors (its activation memory)."""
    return sum((nbytes(t) for t in _tensors(_val(node))), ZERO)


def evaluate(expr, hints: dict | None) -> int:
    """The value of a cost at the example shapes (``hints``: symbol → example value)."""
    expr = sympy.sympify(expr)
    if hints and expr.free_symbols:
        expr = expr.xreplace({s: sympy.Integer(int(v)) for s, v in hints.items()
                              if s in expr.free_symbols})
    if expr.free_symbols:
        raise ValueError(f"cannot evaluate {expr}: no example value for {expr.free_symbols}")
    return int(expr)


def hints_of(gm: torch.fx.GraphModule) -> dict:
    """symbol → example value, from the fake mode's ShapeEnv of the graph's placeholders."""
    vals = [n.meta.get("val", n.meta.get("example_value")) for n in gm.graph.nodes
            if n.op == "placeholder"]
    mode = tc.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    env = getattr(mode, "shape_env", None)
    if env is None:
        return {}
    table = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    hints = dict(table)
    # unbacked sizes (``.item()``, ``.tolist()`` with capture_scalar_outputs) have no example
    # value: costs take the smallest value their range allows, at least 1
    for sym, bounds in getattr(env, "var_to_range", {}).items():
        if sym not in hints and tc.symbol_is_type(sym, tc.SymT.UNBACKED_INT):
            lower = bounds.lower
            hints[sym] = max(1, int(lower) if lower.is_finite else 1)
    return hints
