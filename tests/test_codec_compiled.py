"""The CPU fast path (inductor-compiled references) computes what the eager references compute.

Large CPU tensors take the compiled path (``ccfx.codecs._fast``), so a miscompile would reach
users silently. inductor in torch 2.13 has dropped the tail of a ragged last block before
(a block reduction gathered back by ``arange(n) // block``), so the tensor here is ragged for
every block size (3 × 1001 elements). Tolerances: bit-exact, except block sums taken in
another order (sign's scales, qsgd's norms: rtol 1e-6; qsgd's levels may then move by one).
"""

import pytest
import torch

from ccfx import codecs

SPECS = ["fp16", "bf16", "fp8", "fp8:fmt=e5m2", "int8", "int8:block=33", "int4", "sign", "qsgd",
         "terngrad:block=7", "topk", "threshold:tau=1.5", "randomk", "powersgd",
         "tlc:block=33", "redsync:density=0.05"]


def _run(spec, x, monkeypatch, mode):
    monkeypatch.setenv("CCFX_CODEC_COMPILE", mode)
    codec = codecs.get(spec)  # stateful specs: a fresh object, so both modes start at step 0
    enc = codec.encode(x)
    return enc, codec.decode(enc)


def test_every_codec_with_a_reference_path_is_covered():
    assert {s.split(":")[0] for s in SPECS} == set(codecs.names()) - {"none"}


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_equals_eager_on_a_ragged_tensor(spec, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 1001) * 3
    enc_e, y_e = _run(spec, x, monkeypatch, "0")
    enc_c, y_c = _run(spec, x, monkeypatch, "1")
    summed = spec in ("sign", "qsgd")
    for a, b in zip(enc_c.payload, enc_e.payload, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if spec == "qsgd" and a.dtype == torch.int8:
            assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() < 1e-3
        else:
            torch.testing.assert_close(a, b, rtol=1e-6 if summed else 0, atol=0)
    torch.testing.assert_close(y_c, y_e, rtol=1e-6 if summed else 0,
                               atol=2 * enc_e.payload[1].max().item() / 127 if spec == "qsgd" else 0)


def test_many_shapes_stay_compiled(monkeypatch):
    """A model's edges come in many shapes: past dynamo's default recompile limit (8) the fast
    path must still compile, not fall back to eager silently."""
    from torch._dynamo.utils import counters

    from ccfx.codecs._fast import fast

    @fast
    def double(x):
        return x * 2

    monkeypatch.setenv("CCFX_CODEC_COMPILE", "1")
    counters.clear()
    for n in range(1, 11):
        assert torch.equal(double(torch.ones(n)), torch.full((n,), 2.0))
    assert counters["stats"]["unique_graphs"] == 10


def test_inside_compile_later_a_new_shape_runs_eagerly_and_compiles_after(monkeypatch):
    """A fault-tolerant exchange runs inside ``compile_later``: a signature not compiled yet
    runs eagerly there (the quorum waits on that exchange, not on a compile) and is kept;
    ``compile_now`` compiles it afterwards, and from then on the same signature runs compiled
    inside ``compile_later`` too (nothing kept). The results are the eager ones, bit for bit."""
    from ccfx.codecs._fast import compile_later, compile_now
    from ccfx.codecs.int8 import int8_encode_reference

    monkeypatch.setenv("CCFX_CODEC_COMPILE", "1")
    x = torch.randn(3, 1003)  # a shape no other test compiles
    want = int8_encode_reference.eager(x, 64)
    with compile_later() as later:
        got = int8_encode_reference(x, 64)
    assert [(w, a[1]) for w, a, *_ in later] == [(int8_encode_reference, 64)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    compile_now(later)
    assert later == []
    with compile_later() as again:
        got = int8_encode_reference(x, 64)
        int8_encode_reference(x, 65)  # another block size: another signature
    assert [a[1] for _, a, *_ in again] == [65]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("shape", [(5, 256), (3, 24), (1, 8), (2, 6), (37,), (1,), (4, 9)])
def test_nibble_words_are_bits_pack_and_unpack(shape):
    """int4 packs and unpacks nibbles as int64 / int32 words (``_bits.pack_nibbles``,
    ``_bits.unpack_nibble_rows``): the same bytes as the plain ``_bits.pack`` / ``unpack``,
    eager and compiled, for every ``n`` up to the codes' length (odd ones clear the last high
    nibble), whole rows or not (flattened, padded to words)."""
    from ccfx.codecs import _bits

    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    total = codes.numel()
    packed = torch.compile(_bits.pack_nibbles, dynamic=False)
    for n in sorted({1, total // 2 + 1, total - 1, total} - {0}):
        want = _bits.pack(codes.reshape(-1)[:n], 4)
        assert torch.equal(_bits.pack_nibbles(codes, n), want)
        assert torch.equal(packed(codes, n), want)
    if total % 8 == 0:
        rows = _bits.pack(codes, 4).view(-1, 4)  # (r, 4) bytes: 8 codes a row
        unpack = torch.compile(_bits.unpack_nibble_rows, dynamic=False)
        want = _bits.unpack(rows.reshape(-1), total, 4).view(-1, 8)
        assert torch.equal(_bits.unpack_nibble_rows(rows), want)
        assert torch.equal(unpack(rows), want)


@pytest.mark.parametrize("mode", ["0", "1"])
def test_int4_decodes_a_payload_at_any_byte_offset(mode, monkeypatch):
    """The word-wise int4 decode reads the packed bytes as int32 words: a payload that starts
    at an odd byte of its storage (a view into a received buffer) takes the bytewise form and
    decodes to the same tensor."""
    monkeypatch.setenv("CCFX_CODEC_COMPILE", mode)
    codec = codecs.get("int4")
    x = torch.randn(3, 1001)
    enc = codec.encode(x)
    packed, scales = enc.payload
    buf = torch.zeros(packed.numel() + 1, dtype=torch.uint8)
    buf[1:] = packed
    shifted = type(enc)((buf[1:], scales), enc.ctx)
    assert torch.equal(codec.decode(shifted), codec.decode(enc))
