"""A model compiled with ccfx that runs without ccfx says so (issue 17 part 7).

A GCN whose adjacency is a sparse CSR tensor makes Dynamo give up on its whole ``forward``
(ccfx is never called); a ``torch.compiler.disable``-d block leaves its parameters outside
every ccfx graph. Each warns once (a CcfxWarning quoting Dynamo's reason), or, where the
options ask for stages or data parallel, raises a ConfigError at the first backward (before
any gradient is accumulated) and at every later call. See ``backends/fallbacks.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn

import ccfx
from ccfx.backends import fallbacks

N, D, H, C = 12, 16, 32, 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    # torch._dynamo.reset() drops Dynamo's compile callbacks; ccfx registers them when it is
    # imported (a process that does not reset keeps them) and at every backend it makes
    fallbacks.arm()
    yield
    torch._dynamo.reset()


class GCN(nn.Module):
    """Two graph convolutions, ``adj @ (x W)``: the GNNPipe setting of the issue."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, H), nn.Linear(H, C)

    def forward(self, adj, x):
        return adj @ self.l2(torch.relu(adj @ self.l1(x)))


class BigOutside(nn.Module):
    """A small layer in ccfx's graph, then a large one Dynamo must not trace (8,704 of 11,028
    parameters, 79 %)."""

    def __init__(self):
        super().__init__()
        self.small, self.big, self.out = nn.Linear(D, D), nn.Linear(D, 512), nn.Linear(512, C)

    def forward(self, x):
        return self.out(torch.relu(self.big_block(self.small(x))))

    @torch.compiler.disable
    def big_block(self, x):
        return self.big(x)


class Chatty(nn.Module):
    """A graph break (a print) that leaves no work outside: both halves are ccfx graphs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, C)

    def forward(self, x):
        h = self.a(x)
        print("between the graphs")
        return self.b(torch.relu(h))


def adjacency():
    g = torch.Generator().manual_seed(0)
    dense = (torch.rand(N, N, generator=g) > 0.6).float() + torch.eye(N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return dense.to_sparse_csr()


def features():
    return torch.randn(N, D, generator=torch.Generator().manual_seed(1))


def ccfx_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ccfx.CcfxWarning)]


def steps(compiled, *inputs, n=3):
    """``n`` forward + backward steps, recording every warning; the outputs."""
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            out = compiled(*inputs)
            out.square().mean().backward()
            outs.append(out.detach())
    return outs, ccfx_warnings(caught)


def test_sparse_csr_gcn_warns_once_with_dynamos_reason_and_runs_correctly():
    torch.manual_seed(0)
    model, reference = GCN(), GCN()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="ccfx", options={"lowering": "eager"})
    adj, x = adjacency(), features()
    outs, said = steps(compiled, adj, x)
    assert len(said) == 1, said
    assert "Dynamo could not capture GCN's forward" in said[0]
    assert "runs eagerly, without ccfx" in said[0]
    assert "Attempted to wrap sparse Tensor" in said[0]  # Dynamo's own reason, quoted
    assert "adj.to_dense()" in said[0]  # and a fix
    # it ran, eagerly and correctly: three steps of the same forward, gradients accumulated
    expected = reference(adj, x)
    for out in outs:
        torch.testing.assert_close(out, expected.detach())
    expected.square().mean().backward()
    torch.testing.assert_close(model.l1.weight.grad, 3 * reference.l1.weight.grad)
    # plan_of, which has nothing to show, says why instead of "has not run yet" alone
    with pytest.raises(ccfx.ConfigError, match="Dynamo ran it without ccfx.*sparse Tensor"):
        ccfx.plan_of(compiled)


def test_sparse_csr_gcn_with_stages_raises_at_the_first_backward_and_every_call():
    model = GCN()
    compiled = torch.compile(model, backend="ccfx", options={"stages": 3, "lowering": "eager"})
    adj, x = adjacency(), features()
    out = compiled(adj, x)  # Dynamo's end-of-compile callback may not raise: the eager run
    with pytest.raises(ccfx.ConfigError) as first:
        out.sum().backward()
    text = str(first.value)
    assert text.startswith("ccfx: stages=3 cannot cut code ccfx never sees")
    assert "Attempted to wrap sparse Tensor" in text and "adj.to_dense()" in text
    assert all(p.grad is None for p in model.parameters())  # raised before any accumulation
    for _ in range(2):  # and at every later call, before it runs
        with pytest.raises(ccfx.ConfigError, match="stages=3"):
            compiled(adj, x)


def test_a_large_share_of_parameters_outside_ccfx_warns_once_naming_them():
    torch.manual_seed(0)
    model = BigOutside()
    compiled, backend = _compiled(model)
    outs, said = steps(compiled, features())
    assert backend.graphs, "the small layer and the output layer are ccfx graphs"
    assert len(said) == 1, said
    assert "79% of BigOutside's parameters (8,704 of 11,028: big.weight, big.bias)" in said[0]
    assert "ran outside ccfx's graphs" in said[0]
    assert "torch.compiler.disable()" in said[0]  # Dynamo's reason for the graph break
    torch.testing.assert_close(outs[0], model(features()).detach())


def test_with_data_parallel_any_parameter_outside_is_an_error_before_its_gradient_is_used():
    model = BigOutside()
    compiled, _ = _compiled(model, data_parallel=True)  # no process group: world size 1
    out = compiled(features())
    with pytest.raises(ccfx.ConfigError) as caught:
        out.sum().backward()
    assert str(caught.value).startswith(
        "ccfx: data_parallel=True would leave those gradients different on every rank")
    assert "big.weight" in str(caught.value)
    assert model.big.weight.grad is None
    with pytest.raises(ccfx.ConfigError, match="data_parallel=True"):
        compiled(features())


def test_a_model_captured_whole_or_broken_with_nothing_outside_does_not_warn(capsys):
    for model, options in ((nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C)), {}),
                           (Chatty(), {}), (Chatty(), {"stages": 2})):
        compiled, backend = _compiled(model, **options)
        _, said = steps(compiled, features())
        fallback = [m for m in said if "Dynamo's reason" in m]  # not partition's own notes
        assert backend.graphs and fallback == [], (type(model).__name__, options, said)
    assert "between the graphs" in capsys.readouterr().out  # the break did happen


def test_once_per_compiled_model_and_again_for_another():
    said = []
    for _ in range(2):
        compiled, _ = _compiled(BigOutside())
        said.append(steps(compiled, features(), n=4)[1])
    assert [len(s) for s in said] == [1, 1]


def test_model_compile_and_sync_every_warn_without_raising():
    model = BigOutside()
    model.compile(backend=ccfx.backend(sync_every=4, lowering="eager"))
    _, said = steps(model, features())
    assert len(said) == 1 and "of BigOutside's parameters" in said[0]
    assert "sync_every=4: ccfx.local_steps still averages the parameters" in said[0]


@pytest.mark.slow  # a fresh interpreter importing torch: ~15 s idle on 2 cores
def test_a_fresh_process_is_told_through_the_entry_point_alone(tmp_path):
    """No ``import ccfx``, no reset: torch.compile's lookup of backend="ccfx" imports ccfx,
    which registers the callbacks before the model's first call."""
    script = tmp_path / "gcn.py"
    script.write_text(textwrap.dedent(f"""
        import warnings, torch
        from torch import nn
        warnings.simplefilter("ignore")
        class GCN(nn.Module):
            def __init__(self):
                super().__init__()
                self.l1 = nn.Linear({D}, {C})
            def forward(self, adj, x):
                return adj @ self.l1(x)
        adj = torch.eye({N}).to_sparse_csr()
        compiled = torch.compile(GCN(), backend="ccfx", options={{"lowering": "eager"}})
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(adj, torch.randn({N}, {D}))
        print([type(w.message).__name__ + ": " + str(w.message) for w in caught])
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CcfxWarning: ccfx: Dynamo could not capture GCN's forward" in done.stdout
    assert "Attempted to wrap sparse Tensor" in done.stdout


def _compiled(model, **options):
    options.setdefault("lowering", "eager")
    backend = ccfx.backend(**options)
    return torch.compile(model, backend=backend), backend


def test_fullgraph_leaves_the_telling_to_dynamo():
    compiled = torch.compile(GCN(), backend="ccfx", fullgraph=True, options={"lowering": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match="sparse"):
            compiled(adjacency(), features())
    assert ccfx_warnings(caught) == []
