"""The catalogue table that ``ccfx codecs`` prints: every codec, its parameters (with their
defaults), its wire ratio on a 4096 x 4096 fp32 tensor (exact, from ``wire_bytes``), and its
relative error ``||decode(encode(x)) - x|| / ||x||`` on a sample tensor (seeded, so the table
is the same on every run)."""

from __future__ import annotations

import torch

from . import registry

#: Wire ratios are quoted for this shape (the issue's reference tensor).
RATIO_SHAPE = (4096, 4096)
#: Errors are measured on a smaller sample so the table prints in well under a second.
SAMPLE_SHAPE = (256, 256)


def sample(shape=SAMPLE_SHAPE, seed: int = 0) -> torch.Tensor:
    """A gradient-like sample: a rank-8 signal plus Gaussian noise, fp32."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    signal = torch.randn(rows, 8, generator=g) @ torch.randn(8, cols, generator=g) / 8**0.5
    return signal + 0.3 * torch.randn(rows, cols, generator=g)


def rows(specs=None) -> list[dict]:
    """One dict per codec: spec, params, wire ratio, sample error, reduction, summary."""
    x = sample()
    raw = RATIO_SHAPE[0] * RATIO_SHAPE[1] * torch.float32.itemsize
    out = []
    for spec in specs or registry.names():
        codec = registry.get(spec)
        y = codec.roundtrip(x)
        out.append({
            "spec": codec.spec,
            "params": {k: v for k, v in registry.available()[codec.name].items() if k != "ef"},
            "wire_ratio": float(codec.wire_bytes(RATIO_SHAPE, torch.float32)) / raw,
            "error": float((y - x).norm() / x.norm()),
            "reduction": codec.reduction,
            "summary": codec.summary,
        })
    return out


def format_catalogue(specs=None) -> str:
    lines = [
        f"{'codec':<10} {'parameters':<28} {'wire/fp32':>9} {'rel.err':>8}  {'reduce':<6}  what",
    ]
    for r in rows(specs):
        params = ",".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(
            f"{r['spec']:<10} {params:<28} {r['wire_ratio']:>9.4f} {r['error']:>8.4f}  "
            f"{r['reduction']:<6}  {r['summary']}"
        )
    lines.append(
        f"wire/fp32: exact, on a {RATIO_SHAPE[0]}x{RATIO_SHAPE[1]} fp32 tensor. rel.err: "
        f"||y - x|| / ||x|| for one call on a seeded {SAMPLE_SHAPE[0]}x{SAMPLE_SHAPE[1]} sample "
        "(rank-8 signal + noise; no error feedback)."
    )
    lines.append("Any codec takes 'ef' (error feedback), e.g. 'topk:ratio=0.01,ef'.")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    """``ccfx codecs`` takes no options: it prints the whole catalogue."""


def main(args) -> int:
    print(format_catalogue())
    return 0
