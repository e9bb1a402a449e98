#!/usr/bin/env bash
# ccfx on a CUDA machine, in about 8 minutes, with every figure in ONE file (issue 15, section 4).
#
#   scripts/gpu_check.sh                 # on the GPU machine, from anywhere in the checkout
#   scripts/gpu_check.sh --dry-run       # what would run, and what this machine has; runs nothing
#   scripts/gpu_check.sh --device cpu    # the same steps on the CPU, small: checks this script
#
# Options: --python PATH (default $PYTHON, else python3), --budget-s N (default 480: the whole
# run, installation included), --device cuda|cpu (default cuda), --install auto|shim (shim: no
# pip, the by-hand editable install of step 0; auto: pip first, the shim if pip fails).
#
# Results: $OUT/gpu_check.txt when $OUT is set, else ./gpu_check.txt (the current directory).
# Every step's output goes there (and to stdout), then a "PASS <step>" / "FAIL <step>" /
# "SKIP <step>: <reason>" line; the summary of those lines and the total time close the file.
# A failed step does not stop the others. Exit status: 0 when every step passed, 1 otherwise
# (a skipped step counts: the check did not run), 0 for --dry-run.
#
# Steps:
#   0 setup    torch and triton must be importable already (the machine may reach no network);
#              ccfx is installed from this checkout with `pip install --no-deps -e .`; if pip
#              cannot, an editable install by hand stands in (a finder in a sitecustomize.py on
#              PYTHONPATH, and the entry points, so backend="ccfx" resolves). Only when torch/triton are missing does it
#              try `pip install torch triton`, saying so (that download alone may not fit).
#   1 env      nvidia-smi (one line), python, torch, CUDA, triton, NCCL versions, cores, commit
#   2 triton   tests/test_triton_*.py on CUDA tensors, kernels compiled (CCFX_TEST_DEVICE=cuda)
#   3 codecs   python -m bench.codecs: Triton over the eager torch reference and over inductor's
#   4 demo     ccfx demo --device cuda (the single-process simulation of the 4-stage pipeline)
#   5 dp       scripts/gpu_dp_one_rank.py: data parallel on one NCCL rank
#   6 lightning scripts/gpu_lightning_callback.py: ccfx.integrations.LightningCodecCallback on
#              a CUDA DDP model (Lightning registers its strategy's own hook there: refused)
#   7 torchtitan torchtitan's own trainer with ccfx's comms (examples/torchtitan_fsdp2.py's
#              config function), on every GPU here, from the torchtitan v0.3.0 checkout named by
#              TORCHTITAN_DIR (its debug model reads that checkout's tests/assets/)
#   8 demo-inductor (only if time is left): the demo with --lowering inductor, a few steps
set -u

CALLER_DIR="$PWD"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

export PY="${PYTHON:-python3}"
BUDGET_S=480
DEVICE=cuda
DRY=0
INSTALL=auto
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --python) PY="$2"; shift ;;
        --budget-s) BUDGET_S="$2"; shift ;;
        --device) DEVICE="$2"; shift ;;
        --install) INSTALL="$2"; shift ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$DEVICE" in cuda|cpu) ;; *) echo "--device takes cuda or cpu" >&2; exit 2 ;; esac
case "$INSTALL" in auto|shim) ;; *) echo "--install takes auto or shim" >&2; exit 2 ;; esac

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    RESULTS="$OUT/gpu_check.txt"
else
    RESULTS="$CALLER_DIR/gpu_check.txt"
fi
: > "$RESULTS"

WORK="$(mktemp -d -t ccfx-gpu-check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
# Caches of this run only: a fresh machine's timings, nothing read from or left in $HOME.
export TRITON_CACHE_DIR="$WORK/triton-cache"
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-cache"
export CCFX_CACHE_DIR="$WORK/ccfx-cache"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=20 PIP_RETRIES=1 PIP_NO_INPUT=1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

START_NS=$(date +%s%N)
elapsed() { echo $(( ($(date +%s%N) - START_NS) / 1000000000 )); }
say() { echo "$*" | tee -a "$RESULTS"; }
SUMMARY=()
FAILED=0
record() {  # record STATUS NAME DETAIL
    local detail="${*:3}"
    local line="$1 $2${detail:+: $detail}"
    SUMMARY+=("$line")
    [ "$1" = PASS ] || FAILED=1
    say "$line"
}

# run_step NAME CAP_S RESERVE_S CMD...: CMD under `timeout`, at most CAP_S seconds and never
# into the RESERVE_S seconds the later steps need; its output into the results file and stdout.
run_step() {
    local name="$1" cap="$2" reserve="$3"; shift 3
    local left=$(( BUDGET_S - $(elapsed) - reserve ))
    local limit=$(( cap < left ? cap : left ))
    say ""
    if [ "$limit" -lt 10 ]; then
        say "=== $name ==="
        say "\$ $(printf '%q ' "$@")"
        record SKIP "$name" "out of time: $(elapsed) s of the ${BUDGET_S} s budget used," \
            "${reserve} s kept for the later steps"
        return 0
    fi
    say "=== $name (timeout ${limit} s; $(elapsed) s elapsed of ${BUDGET_S}) ==="
    say "\$ $(printf '%q ' "$@")"
    local t0; t0=$(date +%s%N)
    if declare -F "$1" >/dev/null; then  # a shell function: timeout runs programs only
        export -f "$1"
        set -- bash -c "$1 \"\$@\"" "$@"
    fi
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$RESULTS"
    local rc=${PIPESTATUS[0]}
    local secs; secs=$(awk "BEGIN {printf \"%.1f\", ($(date +%s%N) - $t0) / 1e9}")
    if [ "$rc" -eq 0 ]; then
        record PASS "$name" "${secs} s"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record FAIL "$name" "timed out after ${limit} s (figures above are partial)"
    else
        record FAIL "$name" "exit status $rc after ${secs} s"
    fi
}

finish() {
    say ""
    say "=== summary ($DEVICE, budget ${BUDGET_S} s) ==="
    for line in "${SUMMARY[@]}"; do say "$line"; done
    say "total time: $(elapsed) s"
    say "results: $RESULTS"
    exit "$FAILED"
}

say "ccfx GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname), checkout $ROOT"
say "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git)')"

# ---------------------------------------------------------------------------------------------
# Step 0: what is installed, and ccfx from this checkout.
py_has() { timeout 120 "$PY" -c "$1" >/dev/null 2>&1; }

if ! command -v "$PY" >/dev/null 2>&1; then
    say "no Python: '$PY' not found (set PYTHON or --python)"
    record FAIL setup "no python interpreter"
    for s in env triton codecs demo dp lightning; do record SKIP "$s" "no python"; done
    finish
fi
say "python: $(command -v "$PY") ($("$PY" -V 2>&1))"

# One probe: torch and triton importable? CUDA usable, or why not?
probe_torch() {
    timeout 120 "$PY" - <<'EOF' 2>&1 | tail -1
import shutil
try:
    import torch, triton  # noqa: F401
except Exception as e:  # noqa: BLE001
    print(f"missing: {type(e).__name__}: {e}")
    raise SystemExit
if torch.cuda.is_available():
    print("cuda")
elif torch.version.cuda is None:
    print(f"no CUDA: torch {torch.__version__} is a CPU-only build")
elif shutil.which("nvidia-smi") is None:
    print(f"no CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device, "
          "and there is no nvidia-smi (no NVIDIA driver)")
else:
    print(f"no CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device "
          "although nvidia-smi exists")
EOF
}
read_probe() {  # sets HAVE_TORCH and CUDA_REASON from the probe's answer
    PROBE="$(probe_torch)"
    HAVE_TORCH=1
    CUDA_REASON=""
    case "$PROBE" in
        cuda) ;;
        "no CUDA: "*) CUDA_REASON="${PROBE#no CUDA: }" ;;
        *) HAVE_TORCH=0; say "torch and triton are not both importable by $PY: $PROBE" ;;
    esac
}
read_probe

if [ "$DRY" = 1 ]; then
    say "dry run: nothing is installed or run"
    say "torch+triton importable: $([ "$HAVE_TORCH" = 1 ] && echo yes || echo no)"
    if [ "$HAVE_TORCH" = 1 ]; then
        say "CUDA: ${CUDA_REASON:-available}"
    fi
    say "nvidia-smi: $(command -v nvidia-smi || echo 'not found')"
    say "steps (device $DEVICE, budget $BUDGET_S s): setup (pip install --no-deps -e .), env," \
        "triton (CCFX_TEST_DEVICE=$DEVICE pytest tests/test_triton_*.py), codecs" \
        "(python -m bench.codecs), demo (ccfx demo --device $DEVICE), dp (scripts/gpu_dp_one_rank.py)," \
        "lightning (scripts/gpu_lightning_callback.py), torchtitan (its trainer from" \
        "\$TORCHTITAN_DIR), demo-inductor if time is left"
    say "results would go to $RESULTS"
    exit 0
fi

if [ "$HAVE_TORCH" = 0 ]; then
    say "trying: $PY -m pip install torch triton (needs PyPI; a CUDA torch wheel is about 1 GB," \
        "and the download may not fit the ${BUDGET_S} s budget)"
    run_step "setup: pip install torch triton" 300 120 "$PY" -m pip install torch triton
    read_probe
    if [ "$HAVE_TORCH" = 0 ]; then
        say "torch/triton still missing: install a CUDA build of torch (with triton) first"
        record FAIL setup "torch/triton not importable by $PY"
        for s in env triton codecs demo dp lightning; do record SKIP "$s" "torch/triton not importable"; done
        finish
    fi
fi

# ccfx: already importable from this checkout? Else pip install -e . (no dependencies, no build
# isolation: nothing downloaded), else an editable install by hand (install_shim).
CCFX_FROM_HERE="import ccfx, ccfx.passes, ccfx.backends.triton, os, sys; \
sys.exit(0 if os.path.realpath(ccfx.__file__).startswith(os.path.realpath('$ROOT') + os.sep) else 1)"
install_shim() {
    # setuptools' editable install, by hand: a finder (in sitecustomize.py, on PYTHONPATH) that
    # maps ccfx's packages to their directories in this checkout (pyproject's package-dir:
    # ccfx.passes is passes/, ...), and a dist-info with the entry points (backend="ccfx").
    local shim="$WORK/shim"
    "$PY" - "$ROOT" "$shim" <<'EOF'
import os, re, sys
root, shim = sys.argv[1:]
os.makedirs(shim, exist_ok=True)
text = open(os.path.join(root, "pyproject.toml")).read()
# Installed package -> folder: pyproject's package-dir or setup.py's mapping, else the layout
# known when this was written (passes/, backends/, viz/ at the top, installed under ccfx.).
dirs = {"ccfx": "ccfx", "ccfx.passes": "passes", "ccfx.backends": "backends", "ccfx.viz": "viz"}
setup_py = os.path.join(root, "setup.py")
for source in (text, open(setup_py).read() if os.path.exists(setup_py) else ""):
    for m in re.finditer(r"(?:package-dir\s*=|ROOTS\s*=|package_dir\s*=)\s*\{([^}]*)\}", source):
        dirs.update(re.findall(r'["\']([\w.]+)["\']\s*[=:]\s*["\']([^"\']+)["\']', m.group(1)))
dirs = {name: os.path.join(root, path) for name, path in dirs.items()
        if os.path.exists(os.path.join(root, path, "__init__.py"))}
with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
    f.write(f"""# scripts/gpu_check.sh: ccfx from {root} without pip (an editable install's finder)
import importlib.abc, importlib.util, os, sys

_DIRS = {dirs!r}


class _CcfxCheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        d = _DIRS.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])


sys.meta_path.insert(0, _CcfxCheckoutFinder())
""")
info = os.path.join(shim, "ccfx-0.0.0+checkout.dist-info")
os.makedirs(info, exist_ok=True)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write("Metadata-Version: 2.1\nName: ccfx\nVersion: 0.0.0+checkout\n")
eps = {}
for group, body in re.findall(r"\[project\.(?:entry-points\.([\w.-]+)|scripts)\]\n((?:[^\[\n][^\n]*\n?)*)", text):
    eps.setdefault(group or "console_scripts", []).extend(
        line.replace('"', "").replace(" ", "") for line in body.splitlines() if "=" in line)
with open(os.path.join(info, "entry_points.txt"), "w") as f:
    for group, lines in eps.items():
        f.write(f"[{group}]\n" + "\n".join(lines) + "\n\n")
print(f"shim in {shim}: packages {sorted(dirs)}; entry points {sorted(eps)}")
EOF
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
}

setup_ccfx() {
    if py_has "$CCFX_FROM_HERE"; then
        echo "ccfx already importable from this checkout"
        return 0
    fi
    if [ "$INSTALL" = shim ]; then
        echo "--install shim: no pip"
        return 1
    fi
    echo "\$ $PY -m pip install --no-deps --no-build-isolation -e ."
    if pip_quiet timeout 120 "$PY" -m pip install --no-deps --no-build-isolation -e . \
        && py_has "$CCFX_FROM_HERE"; then
        return 0
    fi
    echo "retrying as a user install (PEP 668 / read-only site-packages)"
    if PIP_BREAK_SYSTEM_PACKAGES=1 pip_quiet timeout 120 "$PY" -m pip install --user --no-deps \
            --no-build-isolation -e . && py_has "$CCFX_FROM_HERE"; then
        return 0
    fi
    return 1
}
pip_quiet() {  # pip's verdict and its errors, not its whole log
    "$@" > "$WORK/pip.log" 2>&1
    local rc=$?
    grep -iE "^error|error:|Successfully|must be|invalid" "$WORK/pip.log" | head -6
    [ "$rc" -eq 0 ] || [ -n "$(grep -iE 'error' "$WORK/pip.log")" ] || tail -3 "$WORK/pip.log"
    return "$rc"
}
say ""
say "=== setup ($(elapsed) s elapsed) ==="
setup_ccfx 2>&1 | tee -a "$RESULTS"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    say "pip could not install ccfx from the checkout: an editable install by hand (PYTHONPATH)"
    install_shim > "$WORK/shim.log" 2>&1  # not in a pipe: it exports PYTHONPATH
    tee -a "$RESULTS" < "$WORK/shim.log"
fi
say "ccfx: $("$PY" -c 'import ccfx, os; print(os.path.dirname(ccfx.__file__))' 2>&1 | tail -1)"
if py_has "$CCFX_FROM_HERE
import torch._dynamo as d
assert 'ccfx' in d.list_backends()"; then
    SETUP_OK=1
else
    SETUP_OK=0
    "$PY" -c "import torch._dynamo as d, ccfx; print('dynamo backends:', d.list_backends())" 2>&1 | tail -2 | tee -a "$RESULTS"
fi
if ! py_has "import pytest"; then
    say "pytest missing: trying pip install pytest"
    timeout 60 "$PY" -m pip install pytest 2>&1 | tail -2 | tee -a "$RESULTS"
fi
if [ "$SETUP_OK" = 1 ]; then
    record PASS setup "ccfx importable from this checkout, backend registered ($(elapsed) s)"
else
    record FAIL setup "ccfx not importable from this checkout, or backend=\"ccfx\" not registered"
fi

# ---------------------------------------------------------------------------------------------
# Step 1: the environment, one block.
env_info() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm \
            --format=csv,noheader 2>&1 | head -1)"
    else
        echo "nvidia-smi: not found"
    fi
    echo "cpu cores: $(nproc), memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    "$PY" - <<'EOF'
import platform, sys
import torch, triton
print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"device 0 of {torch.cuda.device_count()}: {p.name}, {p.total_memory / 2**30:.0f} GiB, "
          f"sm_{p.major}{p.minor}, {p.multi_processor_count} SMs; NCCL {nccl}")
else:
    print("torch sees no CUDA device")
try:
    import pytest
    print(f"pytest {pytest.__version__}")
except ImportError:
    print("pytest: not installed")
EOF
}
run_step env 30 0 env_info

if [ "$DEVICE" = cuda ] && [ -n "$CUDA_REASON" ]; then
    for s in triton codecs demo dp torchtitan demo-inductor; do record SKIP "$s" "no CUDA: $CUDA_REASON"; done
    finish
fi

# ---------------------------------------------------------------------------------------------
# Steps 2-7. Sizes: on CUDA the real ones; with --device cpu (a check of this script) small.
XDIST=""
if py_has "import xdist"; then XDIST="-n 2"; fi  # more processes compiling Triton's kernels
if [ "$DEVICE" = cuda ]; then
    TRITON_TESTS=(tests/test_triton_*.py)
    BENCH=(--mb 64 --inductor-mb 64 --codecs int8 fp8 int4 sign qsgd terngrad threshold powersgd
           fp16 bf16 topk randomk none)
    DEMO=(--device cuda --steps 60)
    DP=(--backend nccl --device cuda --steps 5)
else
    TRITON_TESTS=(tests/test_triton_int8.py tests/test_triton_packing.py)
    BENCH=(--mb 1 --modes eager --reps 3 --codecs int8 fp16)
    DEMO=(--device cpu --steps 3 --stages 2)
    DP=(--backend gloo --device cpu --steps 2 --cases 0 1)
fi

# The test files run side by side, one pytest each (compiling Triton's kernel variants is what
# takes the time, on the host's CPU cores); each line is prefixed with its file's name, so a
# timeout still leaves every file's progress in the results.
triton_tests() {  # triton_tests FILE...
    local f n pids=()
    for f in "$@"; do
        n="$(basename "$f" .py)"; n="${n#test_triton_}"
        (
            CCFX_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -rfE -p no:cacheprovider \
                --durations=3 $XDIST "$f" 2>&1 | sed -u "s/^/[$n] /"
            echo "${PIPESTATUS[0]}" > "$WORK/tests-$n.rc"
        ) &
        pids+=($!)
    done
    wait "${pids[@]}"
    local bad=0
    for f in "$@"; do
        n="$(basename "$f" .py)"; n="${n#test_triton_}"
        echo "$f: pytest exit status $(cat "$WORK/tests-$n.rc" 2>/dev/null || echo '?')"
        [ "$(cat "$WORK/tests-$n.rc" 2>/dev/null)" = 0 ] || bad=1
    done
    return "$bad"
}
export DEVICE WORK XDIST
run_step triton 150 150 triton_tests "${TRITON_TESTS[@]}"
run_step codecs 150 80 "$PY" -m bench.codecs "${BENCH[@]}"
run_step demo 90 40 "$PY" -m ccfx.cli demo "${DEMO[@]}" --no-progress --report ""
run_step dp 90 60 "$PY" scripts/gpu_dp_one_rank.py "${DP[@]}"
# Lightning registers DDPStrategy(ddp_comm_hook=...) on CUDA only: ccfx's callback there (issue 16)
if py_has "import pytorch_lightning"; then
    run_step lightning 60 0 "$PY" scripts/gpu_lightning_callback.py --device "$DEVICE"
else
    record SKIP lightning "pytorch-lightning is not installed (pip install pytorch-lightning)"
fi

# torchtitan's trainer does not start on CPU (torchtitan/trainer.py:301 calls torch.cuda.set_device),
# so its run with ccfx is here: its debug model's tokenizer and c4_test data are the tests/assets/ of
# a torchtitan v0.3.0 checkout (TORCHTITAN_DIR; the machine may reach no network). On one GPU FSDP
# shards over one rank and gathers nothing: the hook point is checked under the real trainer; on
# two or more the compressed comms run too.
torchtitan_trainer() {
    local ngpu; ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
    cd "$TORCHTITAN_DIR" || return 1
    PYTHONPATH="$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m torch.distributed.run \
        --standalone --nproc-per-node "$(( ngpu > 0 ? ngpu : 1 ))" -m torchtitan.train \
        --module torchtitan_fsdp2 --config llama3_debugmodel_ccfx \
        --training.steps 4 --training.seq_len 256 --training.disable_cuda_graphs
}
export ROOT TORCHTITAN_DIR="${TORCHTITAN_DIR:-}"
if [ "$DEVICE" = cpu ]; then
    say "(torchtitan not run: its trainer needs CUDA, torchtitan/trainer.py:301; on CPU:" \
        "tests/test_torchtitan.py)"
elif ! py_has "import torchtitan.trainer"; then
    record SKIP torchtitan "torchtitan's trainer is not importable (pip install torchtitan==0.3.0)"
elif [ ! -d "$TORCHTITAN_DIR/tests/assets/tokenizer" ]; then
    record SKIP torchtitan "set TORCHTITAN_DIR to a torchtitan v0.3.0 checkout (its tests/assets/)"
else
    run_step torchtitan 120 0 torchtitan_trainer
fi

# Extra, only with time left: the demo's partitioned graphs lowered by inductor (CUDA codegen).
if [ "$DEVICE" = cpu ]; then
    say "(demo-inductor not run: CUDA only, inductor's CPU compile of the demo does not fit)"
elif [ $(( BUDGET_S - $(elapsed) )) -ge 75 ]; then
    run_step demo-inductor 75 0 "$PY" -m ccfx.cli demo "${DEMO[@]:0:2}" --steps 10 --stages 2 \
        --lowering inductor --no-progress --report ""
else
    say "(demo-inductor not run: $(( BUDGET_S - $(elapsed) )) s left of ${BUDGET_S})"
fi
finish
