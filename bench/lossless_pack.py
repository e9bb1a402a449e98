"""3LC's lossless stage on real gradients: fp32 bytes over packed bytes while training.

Two small models train in one process, each parameter's gradient a round trip through its own
codec before the optimizer sees it (3LC compresses per tensor; with ``ef``, what a step's
rounding drops is added to the next step's gradient):

  gpt     ccfx's tiny GPT (2 layers, width 64, context 32) on the embedded corpus, AdamW 3e-3
  resnet  a small ResNet-style conv net (3 basic blocks, 16-32 channels) on a synthetic
          10-class 16x16 image set (class prototypes plus noise), SGD 0.05 with momentum

Variants: ``none`` (the reference loss), ``tlc:ef`` (3LC, M = 1) and ``tlc:sparsity=1.5,ef``
(M = 1.5: more zeros). Per step, the ratio is the gradients' fp32 bytes over the bytes the
codec's payloads use (``Codec.used_bytes``: the zero-run-encoded codes, one fp32 scale and the
4-byte length per tensor); the table gives its mean and range over the steps, the share of
values sent as zero, and the final loss (mean of the last 10 steps) minus ``none``'s. Packing
alone (no zero runs: the payload's capacity) would be 20x minus the scales.

    python -m bench.lossless_pack                      # 300 steps, both models
    python -m bench.lossless_pack --steps 20 --models gpt
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from bench import common
from ccfx import codecs
from ccfx.models import CharTokenizer, GPTConfig, TinyGPT, load_corpus
from ccfx.models.corpus import batches

VARIANTS = ("none", "tlc:ef", "tlc:sparsity=1.5,ef")
MODELS = ("gpt", "resnet")
LAST = 10  # the final loss is the mean over this many last steps


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convs with batch norm, a projected shortcut on a stride."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout)))

    def forward(self, x):
        return torch.relu(self.body(x) + self.short(x))


def resnet(classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         Block(16, 16), Block(16, 32, 2), Block(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def image_batches(seed: int, batch: int = 32, classes: int = 10):
    """Endless (images (batch, 3, 16, 16), labels): a class's prototype plus noise."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(classes, 3, 16, 16, generator=g)
    while True:
        labels = torch.randint(0, classes, (batch,), generator=g)
        yield protos[labels] + 4.0 * torch.randn(batch, 3, 16, 16, generator=g), labels


def setup(model: str, seed: int):
    """(module, optimizer, step_loss(i) -> loss tensor) for one model, seeded."""
    torch.manual_seed(seed)
    if model == "gpt":
        text = load_corpus()
        tok = CharTokenizer(text)
        net = TinyGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4,
                                n_embd=64))
        data = batches(tok.encode(text), 16, 32, seed)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3)

        def loss(i):
            x, y = next(data)
            return net(x, y)[1]
    else:
        net = resnet()
        data = image_batches(seed)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def loss(i):
            x, y = next(data)
            return nn.functional.cross_entropy(net(x), y)
    return net, opt, loss


def compress_grads(params, coders) -> tuple[int, int, int]:
    """Each gradient through its codec, in place: (fp32 bytes, used bytes, values sent as 0)."""
    raw = used = zeros = 0
    for p, codec in zip(params, coders):
        enc = codec.encode(p.grad)
        p.grad.copy_(codec.decode(enc))
        raw += p.grad.numel() * 4
        used += codec.used_bytes(enc.payload)
        zeros += int((p.grad == 0).sum())
    return raw, used, zeros


def run(model: str, spec: str, steps: int, seed: int) -> dict:
    """Train ``model`` ``steps`` steps with its gradients through ``spec``; per-step ratios."""
    net, opt, step_loss = setup(model, seed)
    params = [p for p in net.parameters() if p.requires_grad]
    coders = [codecs.get(spec) for _ in params] if spec != "none" else None
    losses, ratios, zero_share = [], [], []
    start = time.perf_counter()
    for i in range(steps):
        loss = step_loss(i)
        loss.backward()
        if coders is not None:
            raw, used, zeros = compress_grads(params, coders)
            ratios.append(raw / used)
            zero_share.append(zeros / (raw // 4))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"model": model, "spec": spec, "steps": steps, "seed": seed,
            "params": sum(p.numel() for p in params), "losses": losses, "ratios": ratios,
            "zero_share": zero_share, "final": statistics.fmean(losses[-LAST:]),
            "seconds": time.perf_counter() - start}


def rows(results: list[dict]) -> list[list]:
    """The table's rows: per model and variant, the ratio's mean and range and the loss."""
    out = []
    ref = {r["model"]: r["final"] for r in results if r["spec"] == "none"}
    for r in results:
        vs = r["final"] - ref[r["model"]] if r["model"] in ref else None
        ratio = (f"{statistics.fmean(r['ratios']):.1f}x", f"{min(r['ratios']):.1f}",
                 f"{max(r['ratios']):.1f}") if r["ratios"] else ("-", "-", "-")
        zeros = f"{100 * statistics.fmean(r['zero_share']):.1f} %" if r["zero_share"] else "-"
        out.append([r["model"], r["spec"], f"{r['params']:,}", *ratio, zeros,
                    f"{r['final']:.3f}", "-" if vs is None else f"{vs:+.3f}"])
    return out


HEADER = ["model", "codec", "params", "ratio mean", "min", "max", "zeros", "final loss",
          "vs none"]


def main(argv=None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    common.quiet()
    torch.set_num_threads(args.threads)
    results = [run(m, v, args.steps, args.seed) for m in args.models for v in args.variants]
    print(f"python -m bench.lossless_pack {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(common.table(rows(results), HEADER))
    print("ratio: fp32 bytes / bytes the payloads use, per step (mean, min, max over steps); "
          "zeros: values sent as 0")
    common.write_json(args.json, "lossless_pack", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
