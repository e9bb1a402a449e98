"""The wire format is pinned: every codec below encodes these inputs to exactly the payload bytes
(and decodes to exactly the tensor) recorded here, as SHA-256 digests.

The CPU codecs are rewritten for speed from time to time (fewer passes, fused kernels); a
receiver on another version must still read the payload. These digests were recorded before
such a rewrite and must keep passing, eager (small tensors, ``CCFX_CODEC_COMPILE=0``) and
compiled (the fast path large CPU tensors take).

The inputs are built from integers (``torch.randint`` and exact powers of two), never from
``randn``, so they are the same on any machine. Codecs whose payload holds a block *sum*
(``sign``'s mean magnitude, ``qsgd``'s norm) are pinned on "dyadic" inputs whose sums are exact
in fp32 whatever the order (a vectorized sum's order depends on the CPU's vector width), with
a last block whose element count is a power of two (``sign`` divides by it). Every other codec
gets "wild" inputs: odd shapes, several dtypes, a dynamic range of 2**80, and blocks of NaN,
±inf, zeros, ``finfo.min`` (an additive mask), fp32 subnormals, ``-0.0`` and rounding ties.

``CCFX_UPDATE_PINS=1`` prints the table for the cases that differ (to record a deliberate wire
format change, with a version note for users).
"""

import hashlib
import os

import pytest
import torch

from ccfx import codecs


def _exp_range(dtype):
    return (-14, 10) if dtype == torch.float16 else (-40, 40)


def wild(shape, dtype, seed):
    """Integers times powers of two (a dynamic range of 2**80 across runs of 50 elements, up to
    2**7 within one) with special values at fixed places: any machine builds the same tensor."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    lo, hi = _exp_range(dtype)
    mant = torch.randint(-2**24, 2**24, (n,), generator=g).double() * 2.0**-24
    runs = torch.randint(lo, hi, (n // 50 + 1,), generator=g).repeat_interleave(50)[:n]
    exps = runs + torch.randint(-7, 1, (n,), generator=g)
    x = mant * torch.pow(2.0, exps.double())
    big = torch.finfo(dtype if dtype != torch.float64 else torch.float32).min
    specials = [(n // 7, [float("nan")]), (n // 3, [float("inf")]), (n // 2, [float("-inf")]),
                (n // 5, [0.0] * 300), (2 * n // 3, [big] * 70 + [1.0] * 30),
                (3 * n // 4, [1e-40, -1e-41, 3e-39] * 20), (4 * n // 5, [-0.0] * 40),
                (5 * n // 6, [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 63.5])]
    for at, values in specials:
        values = torch.tensor(values, dtype=torch.float64)[: n - at]
        x[at:at + len(values)] = values
    return x.to(dtype).view(shape)


def dyadic(shape, dtype, seed, anchor_every=0):
    """Small integers times ``2**e`` (``|e| <= 4``; ``e = 0`` with an anchor), so block sums of
    ``|x| / count`` (count a power of two) and of ``(x / 16)**2`` are exact in fp32; with
    ``anchor_every``, a 16 at every block start makes each block's absmax 16."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    x = torch.randint(-15, 16, (n,), generator=g).double()
    if anchor_every:
        x[::anchor_every] = 16.0
    else:
        x *= torch.pow(2.0, torch.randint(-4, 5, (n,), generator=g).double())
    x[n // 3] = float("nan")  # a NaN block: a NaN scale whatever the order
    return x.to(dtype).view(shape)


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return hashlib.sha256(head + raw).hexdigest()[:16]


def observe(spec, make, shape, dtype, seed, mode, monkeypatch):
    """(payload digests, decoded digest) of ``spec`` on the input ``make`` builds, in ``mode``."""
    monkeypatch.setenv("CCFX_CODEC_COMPILE", mode)
    x = make(shape, dtype, seed)
    codec = codecs.get(spec)  # a fresh object: stateful codecs start at step 0
    enc = codec.encode(x)
    return [digest(p) for p in enc.payload], digest(codec.decode(enc))


def _anchored(block):
    return lambda shape, dtype, seed: dyadic(shape, dtype, seed, anchor_every=block)


#: (spec, input, shape, dtype, seed) → (payload digests, decoded digest), recorded before the
#: CPU fast path's rewrite (issue 38).
CASES = {
    ("int8", wild, (3, 1001), torch.float32, 0):
        (["8a5dd8c0cd7de88c", "e0d6b2f81d335e64"], "2653d30aa24a388b"),
    ("int8", wild, (7, 13, 11), torch.bfloat16, 1):
        (["449d4cab0e346eb5", "7f20ac851f43644f"], "3683995b10aeffcf"),
    ("int8:block=33", wild, (2049,), torch.float16, 2):
        (["15c2552c4acafc75", "cf7df6960b0c7454"], "7675f118d7a713dd"),
    ("int8:block=64", wild, (5, 331), torch.float64, 3):
        (["7d2232b0820afe8b", "931a0e8ad25db5cf"], "a31ea38d9730572a"),
    ("fp8", wild, (3, 1001), torch.float32, 0):
        (["9e6d607a4508ee11", "d4c5221fcfdefdca"], "2e409359977bde5e"),
    ("fp8", wild, (7, 13, 11), torch.bfloat16, 4):
        (["6988547cbce10dfb", "befda7fd3ef20c12"], "cdbbbc711c99cf7d"),
    ("fp8:fmt=e5m2", wild, (2049,), torch.float32, 5):
        (["66079b6584587634", "e690dde441cf81d3"], "191bdc4e8a0e4351"),
    ("fp8:fmt=e5m2,block=17", wild, (5, 331), torch.float16, 6):
        (["fa16628412bfe2f6", "511428db822f46ee"], "1df9083a81dfb093"),
    ("int4", wild, (3, 1001), torch.float32, 0):
        (["26adf7b1c2d52cc1", "4f3d2eafe847ffd4"], "6ce37b390dfba50a"),
    ("int4:block=17", wild, (7, 13, 11), torch.float64, 7):
        (["b09bad2a68ab523b", "13f5bd0ca78aa24f"], "92e27ce2cc1ed06f"),
    ("topk", wild, (3, 1001), torch.float32, 0):
        (["2bc991c84efb3791", "6f4a4835c7355ce1"], "9bbbdc75ed00d464"),
    ("topk:ratio=0.1", wild, (7, 13, 11), torch.bfloat16, 8):
        (["cd2c54b681c56051", "648132219038b7eb"], "c061fa847661c9e3"),
    ("terngrad", wild, (3, 1001), torch.float32, 0):
        (["a7df97439c113a43", "69534a5c833acf1d"], "990b00a796297f8a"),
    ("terngrad:block=7", wild, (2049,), torch.float16, 9):
        (["cdfc7689e307fc6a", "a40e4bb3ddc0e6db"], "85bb10a7c65d68a9"),
    ("sign", dyadic, (29, 53), torch.float32, 10):
        (["016c7c0de509e3cb", "c99ac528205c4fd5"], "cb875b36102e764a"),  # 1537 = 6 * 256 + 1
    ("sign", dyadic, (13, 197), torch.bfloat16, 11):
        (["d14ae70869d9438e", "3f29c52296173f51"], "4b030cd6ce2b432e"),  # 2561 = 10 * 256 + 1
    ("sign:block=32", dyadic, (3, 43, 8), torch.float32, 12):
        (["0b4bd2b70bcc9d04", "65b8a077765d14e2"], "fe31230b138cbd90"),  # 1032 = 32 * 32 + 8
    ("qsgd", _anchored(256), (29, 53), torch.float32, 13):
        (["d020b6a0d929dcd8", "3927e4d1c02158a2"], "c34fda28c65cbc71"),
    ("qsgd:levels=1000,block=64", _anchored(64), (3, 7, 50), torch.float32, 14):
        (["1e61d64f53f3db9b", "32bad333f708e5c7"], "7db29cbef09a559f"),
}

#: Large enough for the compiled fast path (2**17 elements and up, ``ccfx.codecs._fast``) and
#: for top-k's sampled selection; ragged for every block size.
LARGE = {
    ("int8", wild, (517, 263), torch.float32, 20):
        (["ff6815889221d8f6", "f1f3f586ac6dfc5f"], "abe51a606ffe8ffa"),
    ("int8:block=33", wild, (517, 263), torch.bfloat16, 21):
        (["d79ae6e24dca20d6", "031b85a22778456f"], "895c58f9aaa46f61"),
    ("fp8", wild, (517, 263), torch.float32, 22):
        (["b06afd7db36ba1e9", "b6c82a5d06f3a232"], "72e45ad78b505f9c"),
    ("fp8:fmt=e5m2", wild, (517, 263), torch.float16, 23):
        (["2d4b0e2ede0af257", "3b91fdd6bd940e19"], "6fc2dee9ddd5b6b9"),
    ("int4", wild, (517, 263), torch.float32, 24):
        (["96345962c9084425", "97fe3de1ace3d2de"], "b0f1c496ab9bb726"),
    ("topk", wild, (517, 263), torch.float32, 25):
        (["24e5961cc8ebd6cc", "c4ef8e6061a7a858"], "b92d707b49be644f"),
    ("terngrad", wild, (517, 263), torch.float32, 26):
        (["35cd11d128f6c641", "0cd46eb8f4ac11b6"], "428c338a13e7816b"),
    ("sign", dyadic, (135937,), torch.float32, 27):
        (["9b562d2490fedfc6", "945d1263d3b015bf"], "393d219422db4f29"),  # 531 * 256 + 1
    ("qsgd", _anchored(256), (517, 263), torch.float32, 28):
        (["88ce48c7c06ec390", "9d7e44577a2cb4c2"], "045e0b39aa154610"),
}


def _id(case):
    spec, _make, shape, dtype, seed = case
    return f"{spec}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}-{seed}"


def _check(table, case, mode, monkeypatch):
    got = observe(*case, mode, monkeypatch)
    if os.environ.get("CCFX_UPDATE_PINS") == "1" and got != table[case]:
        print(f"\n{_id(case)}: {got!r}")
    payload, decoded = table[case]
    assert got[0] == payload, f"{_id(case)}: the payload bytes changed (the wire format)"
    assert got[1] == decoded, f"{_id(case)}: the decoded tensor changed"


@pytest.mark.parametrize("case", list(CASES), ids=_id)
def test_small_tensors_encode_to_the_pinned_payload_bytes(case, monkeypatch):
    _check(CASES, case, "0", monkeypatch)


@pytest.mark.inductor
@pytest.mark.parametrize("case", list(LARGE), ids=_id)
def test_large_cpu_tensors_encode_to_the_pinned_payload_bytes_compiled(case, monkeypatch):
    monkeypatch.delenv("CCFX_CODEC_COMPILE_MIN_NUMEL", raising=False)
    _check(LARGE, case, "auto", monkeypatch)


@pytest.mark.parametrize("mode", ["0", "1"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_decodes_every_code_to_its_value_bit_for_bit(fmt, mode, monkeypatch):
    """The reference decode of all 256 codes (NaN and inf codes included), eagerly and
    compiled, is the integer definition's (``fp8_values``: a NaN code's canonical NaN, signed
    as the code) bit for bit, times the block's scale."""
    from ccfx.codecs.fp8 import fp8_decode_reference, fp8_values

    monkeypatch.setenv("CCFX_CODEC_COMPILE", mode)
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)
    scales = torch.tensor([1.0, 2.0, 0.5, -3.0])
    got = fp8_decode_reference(codes, scales, 256, fmt, (1024,), torch.float32)
    want = (fp8_values(codes, fmt).view(4, 256) * scales.view(-1, 1)).view(-1)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
