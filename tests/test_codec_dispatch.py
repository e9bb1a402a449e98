"""``ccfx.codecs.implementation``: choosing Triton or the torch reference regardless of device."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ccfx import codecs
from ccfx.codecs.dispatch import current, use_triton
from ccfx.errors import CodecError

from ._triton_interp import kernels

CUDA, CPU = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)


def test_auto_follows_the_device():
    assert current() == "auto"
    assert use_triton(CUDA) and not use_triton(CPU)


def test_reference_overrides_cuda_and_the_override_ends_with_the_block():
    with codecs.implementation("reference"):
        assert current() == "reference"
        assert not use_triton(CUDA)
        assert codecs.get("int8")._impl(CUDA, "encode") is type(codecs.get("int8")).encode_reference
    assert current() == "auto" and use_triton(CUDA)


def test_unknown_choice_names_the_choices():
    with pytest.raises(CodecError, match="auto, triton, reference"), \
            codecs.implementation("cuda"):
        pass


def test_triton_on_cpu_without_the_interpreter_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with codecs.implementation("triton"), pytest.raises(CodecError, match="TRITON_INTERPRET=1"):
        use_triton(CPU)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs the Triton interpreter (set session-wide on GPU-less machines)")
@pytest.mark.parametrize("spec", ["int8", "int4", "sign", "fp8", "terngrad", "qsgd"])
def test_forced_triton_on_cpu_matches_the_reference(spec):
    """The benchmark's and users' override runs the interpreted kernels on CPU tensors: the
    payload is the reference's (bit for bit; sign's scales, block sums in another order, to
    rtol 1e-6 as in its kernel tests, which cover shapes and dtypes)."""
    kernels(spec)
    x = torch.randn(3, 257)
    codec, twin = codecs.get(spec), codecs.get(spec)  # stochastic ones: both at step 0
    with codecs.implementation("reference"):
        ref = twin.encode(x)
    with codecs.implementation("triton"):
        got = codec.encode(x)
        y = codec.decode(got)
    if spec == "qsgd":  # norms in another order may move a level by one (test_triton_stochastic)
        got = codecs.Encoded((ref.payload[0], got.payload[1]), got.ctx)
        y = codec.decode(ref)
    rtol = 1e-6 if spec in ("sign", "qsgd") else 0
    for a, b in zip(got.payload, ref.payload, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=0)
    torch.testing.assert_close(y, codec.decode(ref), rtol=rtol, atol=0)
