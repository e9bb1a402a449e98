import os

# Triton decides at import of triton.language (and at each @triton.jit) whether kernels are
# interpreted. Other imports load triton early (transformers does), so the Triton kernel tests
# can only interpret reliably if the whole session does. Without a GPU that changes nothing else:
# ccfx runs Triton only for CUDA tensors, and inductor emits C++ on CPU.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached frames or recompile limits carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
