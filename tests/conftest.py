import functools
import os
import re
from pathlib import Path

# Triton decides at import of triton.language (and at each @triton.jit) whether kernels are
# interpreted. Other imports load triton early (transformers does), so the Triton kernel tests
# can only interpret reliably if the whole session does. Without a GPU that changes nothing else:
# ccfx runs Triton only for CUDA tensors, and inductor emits C++ on CPU.
#
# CCFX_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs the Triton kernel tests (tests/test_triton_*.py)
# on CUDA tensors instead, their kernels compiled: see _test_device below and tests/_triton_interp.py.
TEST_DEVICE = os.environ.get("CCFX_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu" and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The planner's measured timings: a cache of the test session's own, not the user's
# (~/.cache/ccfx), so tests neither read timings taken elsewhere nor leave theirs behind.
if "CCFX_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["CCFX_CACHE_DIR"] = tempfile.mkdtemp(prefix="ccfx-test-cache-")

# Codecs run eagerly unless a test asks for the compiled CPU path (``ccfx.codecs._fast``):
# compiling every codec in every rank of every spawn costs seconds per process, and the
# compiled path is pinned bit for bit against the eager one on its own (tests/
# test_codec_compiled.py, test_codec_payload_pins.py). The examples run as users run them
# (tests/test_examples.py sets "auto").
os.environ.setdefault("CCFX_CODEC_COMPILE", "0")

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached frames or recompile limits carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


#: Modules that share a worker with the multi-rank ones under ``-n 2`` although they start no
#: ranks: their asserts bound waits on heartbeats, grace windows and beats, so they run beside
#: single-process tests only, never beside a rank spawn.
TIMED = {"test_elastic", "test_elastic_stateful", "test_heal_transport"}

#: Modules that start ranks without tests/ranks.py (Lightning's own launcher, Accelerate's):
#: each run keeps both cores busy as a spawn does. (tests/test_examples.py launches its
#: examples under torchrun too, but only reads what they print, within generous bounds: it
#: runs on the other worker, beside the spawns, which would otherwise leave that worker idle
#: for minutes.)
LAUNCHES = {"test_fsdp2_launchers"}

#: a module that uses the multi-rank harness, tests/ranks.py
_USES_RANKS = re.compile(r"^from \. import (.*, )?ranks\b|^from \.ranks import ", re.MULTILINE)


@functools.cache
def _with_the_ranks(path: Path) -> bool:
    return (path.stem in TIMED or path.stem in LAUNCHES
            or path.is_file() and bool(_USES_RANKS.search(path.read_text())))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n 2`` (pytest-xdist: README) one worker runs every multi-rank module, in order,
    as a serial run does: they share the rank spawns (one per world size, ``shared_ranks``)
    and each spawn keeps both cores mostly busy, so two never run at once. The other worker
    takes the single-process modules one at a time (a module whole: its module-scoped fixtures
    are built once), and the first helps with what is left. Decided here, in the controller,
    from each test's file (xdist's ``xdist_group`` cannot: pytest 9.2 ignores the node id
    xdist rewrites for it). A few single-process modules start processes of their own (the
    demo's, the CLI's, the examples under torchrun) and may run beside a spawn."""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class RanksTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.partition("::")[0]
            return "the multi-rank modules" if _with_the_ranks(root / path) else path

    return RanksTogether(config, log)


@pytest.fixture(scope="session")
def shared_ranks(request, tmp_path_factory):
    """The spawns that the modules of one world size share (tests/ranks.py, ``Shared``)."""
    from .ranks import SharedSpawns

    return SharedSpawns(request.session.items, tmp_path_factory)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone, for the test (``util.group_of_one``)."""
    from .util import group_of_one

    with group_of_one(tmp_path):
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny models gain nothing from more, and lose a lot
    on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    if TEST_DEVICE == "cpu":
        return
    if TEST_DEVICE != "cuda":
        raise pytest.UsageError(f"CCFX_TEST_DEVICE={TEST_DEVICE!r}: use cpu (the default) or cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError("CCFX_TEST_DEVICE=cuda compiles the Triton kernels: unset "
                                "TRITON_INTERPRET")
    if not torch.cuda.is_available():
        raise pytest.UsageError("CCFX_TEST_DEVICE=cuda but torch sees no CUDA device "
                                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")


def pytest_report_header(config):
    if TEST_DEVICE == "cpu":
        how = "interpreted (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else (
            "interpreted per module (tests/_triton_interp.py)")
        return f"ccfx Triton kernel tests: cpu tensors, kernels {how}"
    return (f"ccfx Triton kernel tests: {TEST_DEVICE} tensors ({torch.cuda.get_device_name()}), "
            "kernels compiled")


@pytest.fixture(autouse=True)
def _test_device(request):
    """CCFX_TEST_DEVICE=cuda: in tests/test_triton_*.py, CUDA is torch's default device, so the
    tests' inputs (and the references run on them) are CUDA tensors and the kernels run
    compiled. Every other test, and the default (cpu), is left as it is."""
    if TEST_DEVICE == "cpu" or not request.path.name.startswith("test_triton_"):
        yield
        return
    torch.set_default_device(TEST_DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


