"""``ccfx viz`` and ``ccfx report``: compile a model from the command line and draw it, or write
the HTML report.

    ccfx viz mypkg.models:make_model --stages 4 --codec int8 --input-shape 8,128 -o plan.svg
    ccfx viz path/to/file.py:build --which backward --depth full -o bw.pdf
    ccfx viz plan.json -o stages.png              # a saved Plan (Plan.to_json())
    ccfx report mypkg.models:make_model --stages 4 --steps 3 -o report.html

The target ``module:factory`` names a callable taking no arguments (``module`` is imported with
the current directory on ``sys.path``; ``file.py:factory`` loads a file). It returns either

* a model (``nn.Module``): its example inputs are made from ``--input-shape`` (one per input,
  ``--input-dtype``; integer inputs are drawn from ``[0, --input-high)``), or
* a pair ``(model, example_inputs)``: a tensor, a tuple/list of positional inputs, or a dict of
  keyword inputs; the ``--input-*`` options are then ignored.

The model is compiled with ccfx (``--lowering eager`` by default: quick to compile) and run once
forward and, when its output needs gradients, backward, so forward and backward graphs are both
there to draw. The run is under ``torch.manual_seed(--seed)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ccfx.errors import CcfxError, ConfigError
from ccfx.factory import load_factory

DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16",
          "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float64": "float64", "int64": "int64", "long": "int64", "int32": "int32",
          "int": "int32", "bool": "bool"}


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (write e.g. 8,128)") from None
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (write e.g. 8,128)")
    return dims


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="module:factory or file.py:factory (a callable with no "
                   "arguments returning a model or (model, example_inputs)), or a plan .json")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--codec", default="int8",
                   help="activation codec on every cut, e.g. int8, fp16, int8:block=256 "
                        "(default int8)")
    p.add_argument("--balance", choices=("flops", "params", "memory"), default=None,
                   help="cost the stages balance (default flops)")
    p.add_argument("--lowering", choices=("eager", "inductor"), default="eager",
                   help="what runs the graphs (default eager: quick to compile)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="another ccfx option (value parsed as JSON when it is JSON), repeatable")
    p.add_argument("--input-shape", action="append", type=_shape, default=[], metavar="D0,D1,..",
                   help="shape of one model input (repeat per input) when the factory returns "
                        "only a model")
    p.add_argument("--input-dtype", default="float32", choices=sorted(DTYPES),
                   help="dtype of those inputs (default float32)")
    p.add_argument("--input-high", type=int, default=2,
                   help="integer inputs are drawn from [0, HIGH) (default 2: valid token ids)")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default 0)")


def _add_common(p: argparse.ArgumentParser) -> None:
    """The model arguments and the module docstring's examples as the epilog."""
    p.epilog = __doc__.split("\n\n", 2)[2] if __doc__ else None
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_model_arguments(p)


def add_viz_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("-o", "--output", default="plan.svg",
                   help="file to write: .svg, .png, .pdf or .dot (default plan.svg)")
    p.add_argument("--format", choices=("svg", "png", "pdf", "dot"), default=None,
                   help="output format (default: from the file suffix)")
    p.add_argument("--which", choices=("partitioned", "forward", "backward", "plan"),
                   default="partitioned",
                   help="graph to draw (default partitioned: the graph ccfx cut, with its codec "
                        "ops); plan: stages only")
    p.add_argument("--depth", default="2",
                   help="module levels to show (default 2; a ModuleList index counts with its "
                        "container), or 'full' for every node")
    p.add_argument("--graph", type=int, default=None,
                   help="only this graph (graph breaks make several; default all)")


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("-o", "--output", default="ccfx-report.html",
                   help="HTML file to write (default ccfx-report.html)")
    p.add_argument("--steps", type=int, default=1,
                   help="forward+backward steps to run so the ledger measures bytes (default 1)")
    p.add_argument("--losses", type=Path, default=None, metavar="FILE.json",
                   help='loss curves: a JSON list, or {"run name": [loss per step], ...}')
    p.add_argument("--wire-per-step", type=Path, default=None, metavar="FILE.json",
                   help='bytes on the wire per step: a JSON list or {"run name": [...]}')
    p.add_argument("--depth", default="2", help="module depth of the drawing, or 'full'")
    p.add_argument("--title", default=None, help="report title")


# -- building the model --------------------------------------------------------------------


def build_model(args):
    """(model, positional inputs, keyword inputs) from the target and the --input-* options."""
    import torch

    factory = load_factory(args.target)
    torch.manual_seed(args.seed)
    try:
        made = factory()
    except TypeError as e:
        raise ConfigError(f"{args.target}: the factory must be callable with no arguments "
                          f"({e})") from e
    if isinstance(made, torch.nn.Module):
        model, inputs = made, None
    elif isinstance(made, (tuple, list)) and len(made) == 2 and \
            isinstance(made[0], torch.nn.Module):
        model, inputs = made
    else:
        raise ConfigError(f"{args.target} returned {type(made).__name__}: return a model, or a "
                          "pair (model, example_inputs)")
    if inputs is None:
        if not args.input_shape:
            raise ConfigError(f"{args.target} returned only a model: give --input-shape (one "
                              "per input), or return (model, example_inputs) from the factory")
        dtype = getattr(torch, DTYPES[args.input_dtype])
        made_inputs = []
        for shape in args.input_shape:
            if dtype.is_floating_point:
                made_inputs.append(torch.randn(shape, dtype=dtype))
            elif dtype == torch.bool:
                made_inputs.append(torch.randint(0, 2, shape).bool())
            else:
                made_inputs.append(torch.randint(0, max(args.input_high, 1), shape, dtype=dtype))
        return model, tuple(made_inputs), {}
    if isinstance(inputs, dict):
        return model, (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return model, tuple(inputs), {}
    return model, (inputs,), {}


def _options(args) -> dict:
    options = {"stages": args.stages, "activation_codec": args.codec, "lowering": args.lowering}
    if args.balance:
        options["balance"] = args.balance
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--option {item!r}: write KEY=VALUE")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def _loss(out):
    import torch

    from ccfx import _torch_compat as tc

    try:
        leaves = tc.tree_leaves(out)
    except Exception:  # noqa: BLE001  (an output type pytree does not know)
        leaves = list(out.values()) if hasattr(out, "values") else [out]
    terms = [t.float().square().mean() for t in leaves
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum(terms) if terms else None


def compile_and_run(args, steps: int = 1):
    """Compile the target with ccfx, run ``steps`` forward+backward steps; the backend."""
    import torch

    from ccfx.backends.compiler import CcfxBackend

    from .progress import progress

    model, pos, kw = build_model(args)
    backend = CcfxBackend(**_options(args))
    compiled = torch.compile(model, backend=backend, fullgraph=args.fullgraph)
    for _ in progress(range(max(steps, 1)), desc="ccfx steps", leave=False):
        loss = _loss(compiled(*pos, **kw))
        if loss is not None:
            loss.backward()
    return backend


def _target_plan(args):
    """A Plan when the target is a plan JSON file, else None."""
    if args.target.endswith(".json") and Path(args.target).is_file():
        from ccfx.plan import Plan

        return Plan.from_json(Path(args.target).read_text())
    return None


def _read_series(path: Path | None):
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


# -- commands ------------------------------------------------------------------------------


def run_viz(args) -> int:
    from . import draw
    from .render import GraphvizNotFoundError

    try:
        source = _target_plan(args) or compile_and_run(args)
        which = "plan" if _target_plan(args) is not None else args.which
        path = draw(source, args.output, format=args.format, which=which, depth=args.depth,
                    graph=args.graph)
    except GraphvizNotFoundError as e:
        print(f"ccfx viz: {e}", file=sys.stderr)
        return 1
    except CcfxError as e:
        print(f"ccfx viz: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def run_report(args) -> int:
    from .report import write_report

    try:
        source = _target_plan(args) or compile_and_run(args, steps=args.steps)
        path = write_report(args.output, source, losses=_read_series(args.losses),
                            wire_per_step=_read_series(args.wire_per_step), title=args.title,
                            depth=args.depth)
    except CcfxError as e:
        print(f"ccfx report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
