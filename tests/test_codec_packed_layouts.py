"""The sign and terngrad references build their packed bytes directly (so inductor fuses them);
they must equal the plain formulation through ``_bits.pack`` / ``_bits.unpack`` bit for bit.
Eager only (the compiled copies were checked equal by hand; compiling here costs seconds)."""

import pytest
import torch

from ccfx.codecs import _bits
from ccfx.codecs._random import key, uniform
from ccfx.codecs.base import blocked
from ccfx.codecs.sign import sign_decode_reference, sign_encode_reference
from ccfx.codecs.terngrad import terngrad_encode_reference


def _inputs():
    x = torch.randn(3000)
    x[7], x[2000], x[2500] = float("nan"), float("inf"), -0.0
    return [torch.randn(257, 33), torch.randn(5, 7).t(), torch.zeros(0), torch.tensor(1.5),
            torch.randn(5), torch.zeros(300), x, torch.randn(9).half()]


@pytest.mark.parametrize("block", [256, 5, 1])
def test_sign_matches_bits_pack(block):
    for x in _inputs():
        bits, scales = sign_encode_reference.eager(x, block)
        assert torch.equal(bits, _bits.pack(x.reshape(-1) >= 0, 1))
        n = x.numel()
        y = sign_decode_reference.eager(bits, scales, block, x.shape, x.dtype)
        s = (blocked(torch.ones(n), block) * scales.view(-1, 1)).view(-1)[:n]
        want = torch.where(_bits.unpack(bits, n, 1).bool(), s, -s).view(x.shape).to(x.dtype)
        torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("block", [256, 5, 3, 1])
def test_terngrad_matches_bits_pack(block):
    for step, x in enumerate(_inputs()):
        k = key(0, step)
        codes, scales = terngrad_encode_reference.eager(x, k, block)
        rows = blocked(x.reshape(-1).float(), block)
        noise = uniform(torch.arange(rows.numel()).view(rows.shape), k)
        safe = torch.where(scales.view(-1, 1) > 0, scales.view(-1, 1), 1.0)
        keep = (noise < rows.abs() / safe) & (scales.view(-1, 1) > 0)
        t = torch.where(keep, torch.sign(rows), 0.0)
        assert torch.equal(codes, _bits.pack((t + 1).view(-1)[: x.numel()], 2))
