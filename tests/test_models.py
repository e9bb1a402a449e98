"""The tiny GPT and its embedded corpus: structure, tracing, determinism, that it learns."""

import copy

import pytest
import torch

from ccfx.models import CharTokenizer, GPTConfig, TinyGPT, batches, load_corpus
from ccfx.models.corpus import CORPUS_PATH, HEADER_END

SMALL = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)


def expected_params(c: GPTConfig) -> int:
    # embeddings (LM head tied, counted once) + per block: 2 LayerNorms, qkv, proj, fc, proj
    per_block = 4 * c.n_embd + 12 * c.n_embd**2 + 9 * c.n_embd
    return (c.vocab_size + c.block_size) * c.n_embd + c.n_layer * per_block + 2 * c.n_embd


@pytest.fixture(scope="module")
def data():
    text = load_corpus()
    return CharTokenizer(text).encode(text)


def test_tied_weights_are_one_parameter():
    model = TinyGPT(SMALL)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # deduplicated
    # Gradients from both uses land in the one tensor; copies stay tied.
    idx = torch.randint(0, SMALL.vocab_size, (2, 8))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.lm_head.weight.grad is model.tok_emb.weight.grad
    clone = copy.deepcopy(model)
    assert clone.lm_head.weight is clone.tok_emb.weight
    assert clone.tok_emb.weight is not model.tok_emb.weight


def test_parameter_count():
    demo = TinyGPT(GPTConfig(vocab_size=96))
    assert demo.num_parameters() == expected_params(demo.config) == 3_200_512
    assert 2_000_000 < demo.num_parameters() < 5_000_000
    assert TinyGPT(SMALL).num_parameters() == expected_params(SMALL)


def test_module_names_usable_as_split_points():
    names = dict(TinyGPT(GPTConfig(vocab_size=96, n_layer=4)).named_modules())
    for name in ("tok_emb", "pos_emb", "blocks.0", "blocks.2", "blocks.3.ln1", "blocks.3.attn",
                 "blocks.3.ln2", "blocks.3.mlp", "ln_f", "lm_head"):
        assert name in names


def test_forward_shapes_and_causality():
    torch.manual_seed(0)
    model = TinyGPT(SMALL).eval()
    idx = torch.randint(0, SMALL.vocab_size, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, SMALL.vocab_size)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % SMALL.vocab_size
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])  # no peeking ahead
    _, loss = model(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)


def test_fullgraph_trace_without_graph_breaks():
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (2, 32))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    logits, loss = compiled(idx, idx)
    ref_logits, ref_loss = model(idx, idx)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()


def test_loss_decreases_in_eager(data):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = batches(data, 8, SMALL.block_size, 0)
    losses = []
    for _ in range(20):
        x, y = next(stream)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 4.0  # about ln(96) at init
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8


def test_batches_are_deterministic_from_seed(data):
    def take(seed, n=3):
        stream = batches(data, 4, 16, seed)
        return [next(stream) for _ in range(n)]

    first, again, other = take(0), take(0), take(1)
    for (x1, y1), (x2, y2) in zip(first, again):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))
    gen = torch.Generator().manual_seed(0)
    x, y = next(batches(data, 4, 16, gen))
    assert torch.equal(x, first[0][0])
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_corpus_and_tokenizer():
    raw = CORPUS_PATH.read_text(encoding="ascii")
    assert "Python Software" in raw.split(HEADER_END)[0]  # provenance and licence in the header
    text = load_corpus()
    assert 100_000 <= len(text) <= 300_000
    assert HEADER_END not in text and not text.startswith("Docstrings")  # header stripped
    tok = CharTokenizer(text)
    assert tok.vocab_size <= SMALL.vocab_size
    sample = text[1000:1200]
    ids = tok.encode(sample)
    assert ids.dtype == torch.long and tok.decode(ids) == sample
    assert tok.decode(ids.tolist()) == sample
