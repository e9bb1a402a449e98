"""Drawings, rendering, the HTML report, progress bars and PyTorch logging (ccfx.viz)."""

from __future__ import annotations

import copy
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import ccfx
from ccfx import cli, viz
from ccfx.errors import CcfxWarning, ConfigError
from ccfx.models.tiny_gpt import GPTConfig, TinyGPT
from ccfx.plan import Plan
from ccfx.testing import assert_golden
from ccfx.viz.dot import Digraph, Html, html_text, quote
from ccfx.viz.drawing import truncate_path
from ccfx.viz.render import GraphvizNotFoundError, run_dot
from ccfx.viz.report import report_html

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "viz"
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="graphviz's dot is not installed "
                               "(apt-get install graphviz)")
NASTY = 'a|b{c}d<e>f"g\\h\nnext \\N line & é'


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def compile_tiny(model=None):
    backend = ccfx.backend(stages=2, activation_codec="int8", lowering="eager")
    compiled = torch.compile(model if model is not None else tiny_gpt(), backend=backend)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled(idx).float().square().mean().backward()
    return compiled, backend


@pytest.fixture(scope="module")
def tiny():
    return compile_tiny()


def _edges(dot_text: str) -> list[tuple[str, str]]:
    return re.findall(r'^\s*"([^"]+)" -> "([^"]+)"', dot_text, flags=re.MULTILINE)


def _acyclic(edges) -> bool:
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
    state: dict[str, int] = {}

    def visit(n) -> bool:
        state[n] = 1
        for m in succ.get(n, []):
            if state.get(m) == 1 or (m not in state and not visit(m)):
                return False
        state[n] = 2
        return True

    return all(visit(n) for n in list(succ) if n not in state)


# -- DOT text ------------------------------------------------------------------------------


def test_quote_escapes_every_character_graphviz_treats_specially():
    q = quote(NASTY)
    assert q == r'"a\|b\{c\}d\<e\>f\"g\\h\nnext \\N line & é"'
    inner = q[1:-1]
    assert "\n" not in inner
    # every quote and backslash inside is escaped: stripping escape pairs leaves none
    assert not re.search(r'["\\]', re.sub(r"\\.", "", inner))
    assert html_text('<b>&"x"\'') == "&lt;b&gt;&amp;&quot;x&quot;&#x27;"


@needs_dot
@pytest.mark.parametrize("shape", ["box", "record", "cds"])
def test_escaped_labels_render_as_written(shape):
    g = Digraph()
    g.node(NASTY, label=NASTY, shape=shape)
    g.node("html", label=Html(html_text(NASTY)), shape="box")
    g.edge(NASTY, "html", label=NASTY)
    svg = run_dot(g.source(), "svg").decode()
    texts = [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]
    for line in ('a|b{c}d<e>f"g\\h', "next \\N line & é"):
        assert texts.count(line) >= 3 - (shape == "record"), (line, texts)


def test_dot_is_deterministic_and_free_of_ids(tiny):
    compiled, backend = tiny
    first = viz.to_dot(backend)
    assert viz.to_dot(compiled) == first  # compiled module or backend: the same picture
    _, backend2 = compile_tiny(copy.deepcopy(tiny_gpt()))
    assert viz.to_dot(backend2) == first  # a fresh compile (new hop uids) draws the same
    for which in ("forward", "backward"):
        assert viz.to_dot(backend2, which=which) == viz.to_dot(backend, which=which)
    assert not re.search(r"0x[0-9a-f]{6,}|object at|/work/|\.py", first)


@pytest.mark.parametrize("name,kw", [
    ("tiny_gpt_plan", {"which": "plan"}),
    ("tiny_gpt_modules", {}),
    ("tiny_gpt_modules_depth1", {"depth": 1}),
    ("tiny_gpt_backward", {"which": "backward"}),
    ("tiny_gpt_full", {"depth": "full"}),
])
def test_golden_dot(tiny, name, kw):
    assert_golden(GOLDEN / f"{name}.dot", viz.to_dot(tiny[1], **kw))


def test_drawing_shows_stages_costs_codecs_bytes_and_tied_params(tiny):
    _, backend = tiny
    plan = backend.plan
    text = viz.to_dot(backend)
    assert len(re.findall(r'subgraph "cluster_g0_stage\d+"', text)) == plan.num_stages == 2
    for s in plan.graphs[0].stages:
        assert re.search(rf'label="stage {s.index} · cost [0-9.]+ [kMG]?FLOP \(\d+\.\d%\)', text)
    assert 'shape="cds"' in text and 'fillcolor="#fbd9b0"' in text  # codec ops look distinct
    for e in plan.edges:  # every cut edge: source, shape, dtype, codec, raw → wire
        row = (f"<TD ALIGN=\"LEFT\">e{e.index}</TD><TD ALIGN=\"LEFT\">{e.source}</TD>"
               f"<TD ALIGN=\"LEFT\">{'×'.join(map(str, e.shape))}</TD>"
               "<TD ALIGN=\"LEFT\">float32</TD><TD ALIGN=\"LEFT\"><B>int8</B></TD>"
               "<TD ALIGN=\"RIGHT\">4.0 KiB → 1.0 KiB</TD>")
        assert row in text
    assert 'label="tied: tok_emb.weight\\nstages 0, 1 · 8.0 KiB", shape="cylinder"' in text
    assert text.count('label="tied"') == 2  # dashed arrows to its two users
    assert _acyclic(_edges(text))

    full = viz.to_dot(backend, depth=None)
    for e in plan.edges:  # every node: each ccfx::cut op is its own codec node
        assert f'"g0_{e.source}_to_stage1" [label="e{e.index} · stage 0 → 1 · int8' in full


def test_forward_and_backward_graphs(tiny):
    _, backend = tiny
    fw = viz.to_dot(backend, which="forward")
    bw = viz.to_dot(backend, which="backward")
    assert "<B>stage 0 → 1</B> · 2 activations" in fw and "forward graph" in fw
    assert "<B>stage 1 → 0</B> · 2 gradients" in bw and "backward graph" in bw
    for text in (fw, bw, viz.to_dot(backend, which="backward", depth=None)):
        assert len(re.findall(r'subgraph "cluster_g0_stage\d+"', text)) == 2
        assert _acyclic(_edges(text))
    # the tied weight's two gradients meet in stage 0 without a codec
    assert 'label="tied grad"' in bw


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_module_level_is_acyclic_and_groups_by_module(tiny, depth):
    text = viz.to_dot(tiny[1], depth=depth)
    assert _acyclic(_edges(text))
    boxes = re.findall(r'^\s*"g0_s\d+_([^"]+)_\d+" \[label="', text, flags=re.MULTILINE)
    assert all(len(truncate_path(b, depth).split(".")) <= depth + 1 for b in boxes)
    if depth == 1:
        assert {"blocks.0", "blocks.1", "lm_head", "ln_f"} <= set(boxes)


def test_module_paths_count_a_list_index_with_its_container():
    assert truncate_path("transformer.h.3.attn.c_attn", 2) == "transformer.h.3"
    assert truncate_path("blocks.0.mlp.fc", 1) == "blocks.0"
    assert truncate_path("layers.10", 1) == "layers.10"
    assert truncate_path("", 2) == ""


def test_plan_alone_draws_stages(tiny):
    plan = tiny[1].plan
    text = viz.to_dot(plan)
    assert text == viz.to_dot(Plan.from_json(plan.to_json()))
    assert text == viz.to_dot(tiny[1], which="plan")
    assert '"g0_stage0" -> "g0_cut_0_1"' in text and '"g0_cut_0_1" -> "g0_stage1"' in text
    with pytest.raises(ConfigError, match="a Plan only has stages"):
        viz.to_dot(plan, which="partitioned")
    with pytest.raises(ConfigError, match="depth"):
        viz.to_dot(tiny[1], depth=0)
    assert viz.to_dot(tiny[1], depth="full") == viz.to_dot(tiny[1], depth=None)


def test_backward_before_any_backward_says_so():
    backend = ccfx.backend(stages=2, activation_codec="int8", lowering="eager")
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    torch.compile(model, backend=backend)(torch.randn(2, 8))
    with pytest.raises(ConfigError, match="first .backward"):
        viz.to_dot(backend, which="backward")
    assert "stage 0 → 1" in viz.to_dot(backend, which="forward")


def test_graph_breaks_draw_one_cluster_per_graph():
    from tests.toy_models import GraphBreak

    backend = ccfx.backend(stages=2, activation_codec="int8", lowering="eager")
    torch.compile(GraphBreak(), backend=backend)(torch.randn(2, 32)).sum().backward()
    assert len(backend.graphs) == 2
    for which in ("partitioned", "backward", "plan"):
        text = viz.to_dot(backend, which=which)
        assert 'subgraph "cluster_graph0"' in text and 'subgraph "cluster_graph1"' in text
        assert _acyclic(_edges(text))
    only = viz.to_dot(backend, graph=1)
    assert "cluster_graph" not in only and '"cluster_g1_stage0"' in only
    with pytest.raises(ConfigError, match="graphs 0..1"):
        viz.to_dot(backend, graph=2)


def test_hf_gpt2_module_level(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    backend = ccfx.backend(stages=2, activation_codec="int8", lowering="eager")
    compiled = torch.compile(transformers.GPT2LMHeadModel(cfg), backend=backend)
    compiled(torch.randint(0, 64, (2, 8))).logits.float().square().mean().backward()
    text = viz.to_dot(compiled)
    for block in ("transformer.h.0", "transformer.h.1", "transformer.wte", "lm_head"):
        assert f'[label="{block}\\n' in text
    assert "tied: transformer.wte.weight" in text
    boxes = re.findall(r'^\s*"g0_s[^"]*" \[label=', text, flags=re.MULTILINE)
    nodes = len(backend.graphs[0].partitioned.graph.nodes)
    assert 10 < len(boxes) < nodes / 5  # modules, not nodes
    assert _acyclic(_edges(text))
    if HAS_DOT:
        assert viz.draw(compiled, tmp_path / "gpt2.png").read_bytes()[:4] == b"\x89PNG"


# -- rendering -----------------------------------------------------------------------------


@needs_dot
def test_render_formats(tiny, tmp_path):
    magic = {"svg": b"<?xml", "png": b"\x89PNG", "pdf": b"%PDF"}
    for fmt, head in magic.items():
        path = ccfx.draw(tiny[0], tmp_path / f"plan.{fmt}")
        assert path.read_bytes()[:len(head)] == head
    path = ccfx.draw(tiny[0], tmp_path / "plan.dot")
    assert path.read_text() == viz.to_dot(tiny[0])
    assert viz.draw(tiny[1], tmp_path / "x.out", format="svg").read_bytes().startswith(b"<?xml")
    with pytest.raises(ConfigError, match="cannot draw to 'jpg'"):
        viz.draw(tiny[1], tmp_path / "plan.jpg")


def test_without_dot_writes_the_dot_file_and_says_how_to_install(tiny, tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("dot") is None
    with pytest.raises(GraphvizNotFoundError, match="apt-get install graphviz") as info:
        ccfx.draw(tiny[0], tmp_path / "plan.svg")
    assert info.value.dot_path == tmp_path / "plan.dot"
    assert (tmp_path / "plan.dot").read_text() == viz.to_dot(tiny[0])
    assert not (tmp_path / "plan.svg").exists()
    with pytest.warns(CcfxWarning, match="apt-get install graphviz"):
        page = report_html(tiny[1])
    assert "<details><summary>DOT text of graph</summary><pre>digraph" in page
    # the command line reports it and fails, after writing the .dot
    (tmp_path / "plan.json").write_text(tiny[1].plan.to_json())
    assert cli.main(["viz", str(tmp_path / "plan.json"), "-o", str(tmp_path / "p2.png")]) == 1
    assert (tmp_path / "p2.dot").read_text() == viz.to_dot(tiny[1].plan)


# -- report --------------------------------------------------------------------------------


def _report(backend, path):
    steps = 40
    losses = {"int8": [4.0 * 0.95 ** i + 0.01 * (i % 3) for i in range(steps)],
              "none (baseline)": [4.0 * 0.95 ** i for i in range(steps)]}
    wire = {"int8": [2080.0 * 2] * steps, "none": [8192.0 * 2] * steps}
    return viz.write_report(path, backend, losses=losses, wire_per_step=wire,
                            notes=["a <note> & more"])


def test_report_is_one_self_contained_file(tiny, tmp_path):
    page = _report(tiny[1], tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    for section in ("Drawing", "Stages", "Cut edges", "Loss", "Wire bytes per step",
                    "Configuration"):
        assert f"<h2>{section}</h2>" in page
    assert "<script" not in page and not re.search(r"(src|href)=\"(https?:)?//", page)
    assert "a &lt;note&gt; &amp; more" in page
    assert "Stage balance (graph 0)" in page and "raw vs on the wire" in page
    assert "Training loss, with and without compression" in page
    if HAS_DOT:  # the drawing is inline SVG, without its XML prolog; ids unique
        assert page.count('<div class="drawing"') == 2 and "<?xml" not in page
        ids = re.findall(r'\bid="([^"]+)"', page)
        assert len(ids) == len(set(ids))
    plan_only = report_html(Plan.from_json(tiny[1].plan.to_json()))
    assert "<h2>Loss</h2>" not in plan_only and "Stage balance" in plan_only


def _browser_check():
    path = ROOT / "scripts" / "check_report_in_browser.py"
    spec = importlib.util.spec_from_file_location("check_report_in_browser", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_dot
def test_report_in_headless_chromium(tiny, tmp_path):
    check = _browser_check()
    if check.find_browser() is None:
        reason = "no Chromium: apt-get install -y chromium (Debian's package) to run this check"
        print(reason)
        pytest.skip(reason)
    result = check.check_html(_report(tiny[1], tmp_path / "r.html"), tmp_path / "shot.png")
    assert result["errors"] == [] and result["external_requests"] == []
    assert result["drawings_ok"], result["drawings"]
    assert "stage 0" in result["drawings"][0]["text"] and "stage 1 → 0" not in result["title"]
    assert (tmp_path / "shot.png").read_bytes()[:4] == b"\x89PNG"
    assert result["ok"]
    # the check itself catches what it looks for
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><div class="drawing"></div><img src="missing.png">'
                   '<script>console.error("boom"); nope();</script></body></html>')
    result = check.check_html(bad)
    assert not result["ok"] and not result["drawings_ok"]
    text = "\n".join(result["errors"])
    assert "boom" in text and "nope is not defined" in text and "missing.png" in text


# -- command line --------------------------------------------------------------------------


MODELS = textwrap.dedent("""
    import torch

    def mlp():
        return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])

    def mlp_with_inputs():
        return mlp(), (torch.randn(4, 16),)

    def not_a_model():
        return 3
""")


def test_cli_viz_and_report(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    main = cli.main
    assert main(["viz", "cli_models:mlp_with_inputs", "--stages", "3", "-o", "a.dot"]) == 0
    text = (tmp_path / "a.dot").read_text()
    assert len(re.findall(r'subgraph "cluster_g0_stage\d+"', text)) == 3
    assert main(["viz", "cli_models.py:mlp", "--input-shape", "4,16", "--stages", "2",
                 "--which", "backward", "--depth", "full", "-o", "b.dot"]) == 0
    assert "<B>stage 1 → 0</B>" not in (tmp_path / "b.dot").read_text()  # full: one per op
    assert "stage 1 → 0 · int8" in (tmp_path / "b.dot").read_text()
    assert main(["viz", "cli_models:mlp", "-o", "c.dot"]) == 2
    assert "give --input-shape" in capsys.readouterr().err
    assert main(["viz", "cli_models:not_a_model", "-o", "c.dot"]) == 2
    assert main(["viz", "cli_models:missing", "-o", "c.dot"]) == 2
    (tmp_path / "losses.json").write_text(json.dumps({"int8": [3, 2, 1], "none": [3, 2.5, 2]}))
    assert main(["report", "cli_models:mlp_with_inputs", "--stages", "2", "--steps", "2",
                 "--losses", "losses.json", "-o", "r.html"]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Loss</h2>" in page and "Measured by the ledger (2 step(s))" in page


# -- progress ------------------------------------------------------------------------------


def test_progress_only_on_rank_zero_and_terminals(monkeypatch):
    monkeypatch.delenv("CCFX_PROGRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert list(viz.progress(range(3))) == [0, 1, 2]
    assert viz.progress(range(3)).disable  # pytest's stderr is not a terminal
    assert not viz.progress(range(3), force=True).disable
    monkeypatch.setenv("RANK", "1")
    assert viz.progress(range(3), force=True).disable
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CCFX_PROGRESS", "1")
    assert not viz.progress(range(3)).disable
    monkeypatch.setenv("CCFX_PROGRESS", "0")
    assert viz.progress(range(3), force=True).disable

    class Tty:
        def isatty(self):
            return True

        def write(self, s):
            pass

        def flush(self):
            pass

    monkeypatch.delenv("CCFX_PROGRESS")
    assert not viz.progress(range(3), file=Tty()).disable


# -- PyTorch logging and tracing -----------------------------------------------------------


LOG_SCRIPT = textwrap.dedent("""
    import torch, ccfx
    from ccfx.plan import Plan
    from ccfx.viz import emit_plan_artifact, install

    install()
    backend = ccfx.backend(stages=2, activation_codec="int8", lowering="eager")

    def with_artifact(gm, example_inputs):  # what the backend does once it calls the hook
        compiled = backend(gm, example_inputs)
        g = backend.graphs[-1]
        emit_plan_artifact(Plan(backend.config.to_dict(), [g.plan]).to_json(), g.index)
        return compiled

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    torch.compile(model, backend=with_artifact)(torch.randn(2, 8)).sum().backward()
""")


def test_torch_logs_and_torch_trace(tmp_path):
    env = {**os.environ, "TORCH_LOGS": "ccfx", "TORCH_TRACE": str(tmp_path / "trace"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", LOG_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "ccfx plan: 1 graph(s), codec int8" in done.stderr
    assert re.search(r"edge\s+source\s+stages", done.stderr)
    traces = list((tmp_path / "trace").glob("*.log"))
    assert traces
    lines = "".join(p.read_text() for p in traces).splitlines()
    # tlparse's format: a glog line with the metadata JSON, then the payload, tab-indented
    at = next(i for i, line in enumerate(lines)
              if '{"artifact": {"name": "ccfx_plan_graph0", "encoding": "json"}' in line)
    payload = []
    for line in lines[at + 1:]:
        if not line.startswith("\t"):
            break
        payload.append(line[1:])
    plan = Plan.from_json("\n".join(payload))
    assert plan.num_stages == 2 and plan.edges[0].codec == "int8"


def test_install_registers_ccfx_with_torch_logging():
    from torch._logging import _internal

    viz.install()
    viz.install()  # idempotent
    assert _internal.log_registry.log_alias_to_log_qnames["ccfx"] == ["ccfx"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        viz.emit_plan_artifact("{}", 0)  # without TORCH_TRACE: nothing happens


def test_boundary_tables_give_dtype_and_codec_columns_of_their_own(tiny):
    """Not one word ("float32int8"): a header row names the columns, each value in its own."""
    dot = viz.to_dot(tiny[1], which="plan")
    assert "<I>dtype</I>" in dot and "<I>codec</I>" in dot
    assert re.search(r'<TD ALIGN="LEFT">float32</TD><TD ALIGN="LEFT"><B>int8</B></TD>', dot)
    assert "float32 int8" not in dot and "float32int8" not in dot


def test_one_colour_per_meaning_across_the_report_charts(tiny):
    from ccfx.viz.report import UNCOMPRESSED_COLOUR, WIRE_COLOUR, run_colours

    # the pipeline demo's charts: the baseline first in the loss chart, last in the wire chart
    assert run_colours(["baseline (eager, uncompressed)", "ccfx 4 stages, int8"]) == {
        "baseline (eager, uncompressed)": UNCOMPRESSED_COLOUR, "ccfx 4 stages, int8": WIRE_COLOUR}
    assert run_colours(["on the wire (int8)", "uncompressed"]) == {
        "on the wire (int8)": WIRE_COLOUR, "uncompressed": UNCOMPRESSED_COLOUR}
    page = report_html(tiny[1], losses={"baseline (eager, uncompressed)": [3.0, 2.0],
                                     "ccfx int8": [3.1, 2.1]},
                       wire_per_step={"on the wire (int8)": [1.0, 1.0], "uncompressed": [4.0, 4.0]})
    charts = re.findall(r"<svg.*?</svg>", page, flags=re.DOTALL)
    loss = next(c for c in charts if "Training loss" in c)
    wire = next(c for c in charts if "Bytes on the wire per step" in c)
    for chart in (loss, wire):
        assert UNCOMPRESSED_COLOUR in chart and WIRE_COLOUR in chart
    edges = next(c for c in charts if "per edge" in c)
    assert f'fill="{UNCOMPRESSED_COLOUR}"><title>' in edges
    assert f'fill="{WIRE_COLOUR}"><title>' in edges


@needs_dot
def test_rendering_goes_through_the_graphviz_package_the_project_declares(monkeypatch):
    """pyproject declares ``graphviz``; viz renders with it (``graphviz.pipe``), its errors and
    stderr become ccfx's error and warning."""
    import graphviz

    calls = []
    real = graphviz.pipe

    def spy(engine, fmt, data, **kw):
        calls.append((engine, fmt))
        return real(engine, fmt, data, **kw)

    monkeypatch.setattr(graphviz, "pipe", spy)
    g = Digraph()
    g.node("a", label="a|b")
    assert run_dot(g.source(), "svg").startswith(b"<?xml")
    assert calls == [("dot", "svg")]
    with pytest.raises(ccfx.CcfxError, match=r"`dot -Tsvg` failed \(exit 1\)"):
        run_dot("digraph { a -> }", "svg")
    with pytest.warns(CcfxWarning, match="graphviz: "):
        run_dot('digraph { a [shape="nosuchshape"] }', "svg")


NO_GRAPHVIZ_PACKAGE = """
import sys
sys.modules["graphviz"] = None          # `import graphviz` raises ImportError from here on
import torch, ccfx
from ccfx import cli
from ccfx.viz.render import GraphvizNotFoundError, run_dot
compiled = torch.compile(torch.nn.Linear(4, 4), backend="ccfx", options={"stages": 1})
compiled(torch.randn(2, 4))
for command in ("demo", "viz"):
    args = cli.build_parser().parse_args([command] + (["m:f"] if command == "viz" else []))
    assert not getattr(args, "_unavailable", None), args._unavailable
try:
    run_dot("digraph { a }", "svg")
except GraphvizNotFoundError as e:
    print("told:", e)
"""


def test_without_the_graphviz_package_ccfx_compiles_and_drawing_says_what_to_install():
    """A machine without the ``graphviz`` Python package (a bare GPU image) still imports the
    backend and the CLI; the first drawing says ``pip install graphviz``."""
    done = subprocess.run([sys.executable, "-c", NO_GRAPHVIZ_PACKAGE], check=False,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "told:" in done.stdout
    assert ("pip install graphviz" if HAS_DOT else "not on PATH") in done.stdout
