import os

# Triton decides at import of triton.language (and at each @triton.jit) whether kernels are
# interpreted. Other imports load triton early (transformers does), so the Triton kernel tests
# can only interpret reliably if the whole session does. Without a GPU that changes nothing else:
# ccfx runs Triton only for CUDA tensors, and inductor emits C++ on CPU.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The planner's measured timings: a cache of the test session's own, not the user's
# (~/.cache/ccfx), so tests neither read timings taken elsewhere nor leave theirs behind.
if "CCFX_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["CCFX_CACHE_DIR"] = tempfile.mkdtemp(prefix="ccfx-test-cache-")

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached frames or recompile limits carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny models gain nothing from more, and lose a lot
    on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Modules whose every test starts rank processes but that cannot carry the marker themselves
#: yet (tests/test_dp_training.py is being rewritten): marked ``slow`` here.
SLOW_MODULES = {"test_dp_training.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
