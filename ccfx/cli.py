"""``ccfx`` on the command line. Each subcommand lives in the module that owns its work; this
file only maps names to (module, add_arguments, run) and imports the module when it is used."""

from __future__ import annotations

import argparse
import importlib
import sys

#: name → (module, function adding the arguments, function running the command, help)
COMMANDS = {
    "demo": ("ccfx.demo", "add_arguments", "main",
             "train the tiny GPT with 4 stages and int8 cuts beside the uncompressed baseline"),
    "run": ("ccfx.run_pipeline", "add_arguments", "main",
            "train a model as a real pipeline (x data parallel) on local gloo ranks"),
    "codecs": ("ccfx.codecs.catalogue", "add_arguments", "main",
               "print the codec catalogue: parameters, wire ratio, error on a sample"),
    "viz": ("ccfx.viz.cli", "add_viz_arguments", "run_viz",
            "draw the partitioned graph of module:factory"),
    "report": ("ccfx.viz.cli", "add_report_arguments", "run_report",
               "write a self-contained HTML report"),
    "plan": ("ccfx.backends.plan_parallel", "add_arguments", "main",
             "choose the pipeline x data (x tensor) layout of module:callable on a cluster"),
}


#: what ``ccfx --help`` says above and below the command list (whole sentences)
DESCRIPTION = "ccfx: a torch.compile backend for compressed distributed training."
EPILOG = "Run `ccfx <command> --help` for the options of one command."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ccfx", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (module, add_args, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            getattr(importlib.import_module(module), add_args)(p)
        except (ImportError, AttributeError) as e:  # a command whose module is not built yet
            p.set_defaults(_unavailable=f"`ccfx {name}` is not available: {e}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    module, _, run, _ = COMMANDS[args.command]
    from ccfx.errors import ConfigError

    try:
        return int(getattr(importlib.import_module(module), run)(args) or 0)
    except ConfigError as e:  # bad input: its message names the problem and the fix
        print(f"ccfx {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
