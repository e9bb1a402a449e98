import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached frames or recompile limits carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
