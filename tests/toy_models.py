"""Small models the tests share: each exercises one thing the partitioner must handle."""

import torch
import torch.nn.functional as F
from torch import nn

from ccfx.models.tiny_gpt import GPTConfig, TinyGPT


class MLP(nn.Module):
    def __init__(self, width=32, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class LongSkip(nn.Module):
    """The input's projection is added back after every layer: it crosses every cut."""

    def __init__(self, width=32, depth=8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        skip = self.inp(x)
        h = skip
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h + skip


class ConvBN(nn.Module):
    def __init__(self, channels=8, depth=4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                          nn.ReLU(inplace=True))
            for _ in range(depth)
        )
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (used in the first and last stage)."""

    def __init__(self, vocab=64, width=32, depth=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.head(x)


class MultiOut(nn.Module):
    """A multi-output op (max returns values and indices) and two graph outputs."""

    def __init__(self, width=32, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        x = self.layers[0](x)
        values, indices = x.max(dim=-1, keepdim=True)
        for layer in self.layers[1:]:
            x = torch.relu(layer(x)) + values
        a, b = x.chunk(2, dim=-1)
        return a * b, indices


class InPlace(nn.Module):
    def __init__(self, width=32, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        h = self.layers[0](x)
        for layer in self.layers[1:]:
            y = layer(h)
            y.mul_(0.5)
            h = h + y.relu_()
        return h


class GraphBreak(nn.Module):
    def __init__(self, width=32, depth=6):
        super().__init__()
        self.first = MLP(width, depth // 2)
        self.second = MLP(width, depth - depth // 2)

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class BreakThenMLP(nn.Module):
    """A few FLOPs without parameters, a graph break, then an MLP: the first graph cannot know
    what follows."""

    def __init__(self, width=32, depth=8):
        super().__init__()
        self.body = MLP(width, depth)

    def forward(self, x):
        x = x * 2 + 1
        torch._dynamo.graph_break()
        return self.body(x)


def two_layer_mlp(width=256, hidden=1024):
    """Linear up to ``hidden``, ReLU, Linear back to ``width``: two weight matrices."""
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))


def relu_stack(layers=8, width=256):
    """``layers`` times (Linear(width, width), ReLU), as one nn.Sequential."""
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def tiny_gpt(n_embd=256, batch=16, n_layer=4):
    """ccfx's TinyGPT (vocabulary 96, context 64, 4 heads) from seed 0, and a batch of
    ``batch`` random token rows as its (input, target) pair."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=96, block_size=64, n_layer=n_layer, n_head=4,
                              n_embd=n_embd))
    idx = torch.randint(0, 96, (batch, 64))
    return model, (idx, idx)
