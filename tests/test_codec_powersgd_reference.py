"""External reference: ccfx's powersgd against PyTorch's own ``powerSGD_hook``.

Same gradient matrices, same rank, warm start and error feedback, same initial Q (the hook seeds
it with ``np.random.RandomState(random_seed).randint(1_000_000_000)``; that number is our
``seed``), one gloo rank: every step's decompressed gradient must agree to float tolerance.
The hook is called directly with a minimal stand-in for ``dist.GradBucket`` holding one tensor.
"""

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from ccfx import codecs

from . import util


class _Bucket:
    """What powerSGD_hook reads from a GradBucket, for a bucket of one tensor."""

    def __init__(self, grad: torch.Tensor):
        self._buffer = grad.reshape(-1).clone()
        self._shape = grad.shape

    def buffer(self):
        return self._buffer

    def gradients(self):
        return [self._buffer.view(self._shape)]

    def index(self):
        return 0

    def is_last(self):
        return True


@pytest.fixture(scope="module")
def single_rank_group(tmp_path_factory):
    with util.group_of_one(tmp_path_factory.mktemp("pg")):
        yield


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("shape", [(48, 32), (24, 4, 5)])
def test_matches_torch_powersgd_hook(single_rank_group, rank, shape):
    random_seed = 7
    state = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,  # the hook insists on > 1 with error feedback / warm start
        min_compression_rate=1,  # compress whenever low rank is smaller, as ccfx does
        use_error_feedback=True,
        warm_start=True,
        random_seed=random_seed,
    )
    seed = np.random.RandomState(random_seed).randint(1_000_000_000)
    ours = codecs.get(f"powersgd:rank={rank},seed={seed},ef")
    g = torch.Generator().manual_seed(0)
    compared = 0
    for step in range(7):
        # Low-rank-ish gradients plus noise, so warm start matters.
        base = torch.randn(shape[0], 3, generator=g) @ torch.randn(3, int(np.prod(shape[1:])), generator=g)
        grad = (base + 0.1 * torch.randn(base.shape, generator=g)).view(shape)
        got = psgd.powerSGD_hook(state, _Bucket(grad)).wait().view(shape)
        if step < state.start_powerSGD_iter:
            continue  # the hook's uncompressed warm-up steps
        mine = ours.roundtrip(grad)
        # fp32 tolerance: QR and matmul order differ (bmm vs mm); values are O(1).
        torch.testing.assert_close(mine, got, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared == 5
