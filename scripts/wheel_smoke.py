"""Smoke test of an installed ccfx wheel, run by .ci/run from a clean virtual environment
outside the repository (so nothing is imported from the source tree).

    python scripts/wheel_smoke.py --repo /path/to/checkout

Checks, each one a path a release user takes first:
1. every package folder of the repository was installed (a hand-written package list once
   shipped a wheel without ccfx/planner);
2. a compile with an ``auto`` codec, and ``ccfx.explain`` (the planner);
3. one local-steps sync on one process (``ccfx.local_steps``, its default
   ``outer_collective="auto"`` resolved by cost);
4. ``ccfx demo --help`` (the console script);
5. ``import ccfx`` prints no warning, and the demo's corpus is installed (package data).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import subprocess
import sys

#: installed package -> folder of the repository (as setup.py maps them)
ROOTS = {"ccfx": "ccfx", "ccfx.passes": "passes", "ccfx.backends": "backends", "ccfx.viz": "viz"}


def check_packages(repo: pathlib.Path) -> None:
    import importlib

    import ccfx

    here = pathlib.Path(ccfx.__file__).resolve().parent
    assert repo.resolve() not in here.parents, f"ccfx was imported from the checkout ({here})"
    missing = []
    for name, folder in ROOTS.items():
        for init in sorted((repo / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(repo / folder).parts
            module = ".".join((name, *rel))
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                missing.append(f"{module} ({e})")
    assert not missing, f"the installed wheel lacks: {missing}"
    print(f"packages: every folder of {repo} is installed under {here}")


def check_auto_and_explain() -> None:
    import torch

    import ccfx

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "stages": 2, "activation_codec": "auto", "link_gbps": 0.01, "microbatches": 4})
    compiled(torch.randn(16, 256)).sum().backward()
    text = ccfx.explain(compiled)
    assert "predicted step" in text, text
    print("auto + explain:\n  " + "\n  ".join(text.splitlines()[:6]))


def check_local_steps_one_process() -> None:
    import torch
    import torch.distributed as dist

    import ccfx

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = ccfx.local_steps(model, opt, sync_every=2, outer_codec="int8")
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert moved, "the parameters did not move over two steps and a sync"
        state = outer.state_dict()
        assert state["step"] == 2 and state["syncs"] >= 1, state
        assert 0 < state["wire_bytes"] < state["raw_bytes"], "int8 did not shrink the sync"
        print(f"local steps: {state['syncs']} sync on one process, "
              f"{state['wire_bytes']} of {state['raw_bytes']} bytes on the wire")
    finally:
        dist.destroy_process_group()


def check_quiet_import_and_data() -> None:
    """``import ccfx`` prints no warning (torch._dynamo warns without numpy, a dependency for
    that reason), and the demo's corpus was shipped as package data."""
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import ccfx"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    from ccfx.models.corpus import CORPUS_PATH

    assert CORPUS_PATH.is_file() and CORPUS_PATH.stat().st_size > 0, CORPUS_PATH
    print(f"import: quiet; package data: {CORPUS_PATH.name} ({CORPUS_PATH.stat().st_size} B)")


def check_cli() -> None:
    exe = shutil.which("ccfx") or str(pathlib.Path(sys.executable).parent / "ccfx")
    out = subprocess.run([exe, "demo", "--help"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stdout + out.stderr
    print(f"cli: `ccfx demo --help` ({len(out.stdout.splitlines())} lines)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=pathlib.Path, required=True,
                        help="the checkout the wheel was built from")
    args = parser.parse_args()
    os.environ.setdefault("CCFX_CACHE_DIR", str(pathlib.Path.cwd() / "ccfx-cache"))
    check_packages(args.repo)
    check_quiet_import_and_data()
    check_auto_and_explain()
    check_local_steps_one_process()
    check_cli()
    print("wheel smoke test: passed")


if __name__ == "__main__":
    main()
