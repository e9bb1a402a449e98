"""Collectives in the drawings and the HTML report (issue 18, "seen and counted").

Single process. A plan with collectives is built by hand (compressed and left-alone rows,
forward and backward) for the plan drawing and the report; a GraphView built by hand for a
compressed collective's node in the forward graph; and one real compile under a gloo group of
one rank (the user's funcol all-reduce, which ccfx leaves alone there: a group of one sends
nothing) for the forward and backward drawings, the ledger's calls and the browser check.
The 2-rank drawing of compressed collectives is in tests/test_collectives_pass.py.
"""

from __future__ import annotations

import html
import re
import shutil

import pytest
import torch

import ccfx
from ccfx import viz
from ccfx.plan import Collective, GraphPlan, Plan, Stage
from ccfx.viz.collectives import KEPT_FILL, bytes_text
from ccfx.viz.drawing import CODEC_FILL, graph_dot
from ccfx.viz.report import report_html
from ccfx.viz.view import GraphView, VNode

from . import util
from .test_viz import _acyclic, _browser_check, _edges

HAS_DOT = shutil.which("dot") is not None
REASON = "collective_overrides['collective 1'] is 'none' <&>"


def _rows() -> list[Collective]:
    return [
        Collective(0, 0, "forward", "all_reduce", "0", 2, [4, 16], "torch.float32", "int8",
                   256, 72, "sum"),
        Collective(0, 1, "forward", "all_reduce", "0", 2, [4, 16], "torch.float32", "none",
                   256, 256, "max", REASON),
        Collective(0, 2, "backward", "reduce_scatter", "0", 2, [8, 16], "torch.float32",
                   "int4:ef", 256, 40, "sum"),
    ]


def _plan(rows=None) -> Plan:
    stage = Stage(0, 0, ["x", "linear"], 1000.0, "1000", 1000, 64)
    g = GraphPlan(0, 1, 1, "flops", [stage], [], [], collectives=_rows() if rows is None else rows)
    plan = Plan({"collective_codec": "int8", "activation_codec": "none"}, [g])
    return Plan.from_json(plan.to_json())  # what `ccfx report plan.json` reads


def _node_attrs(dot: str, node_id: str) -> str:
    m = re.search(rf'^\s*"{re.escape(node_id)}" \[(.*)\];$', dot, flags=re.MULTILINE)
    assert m, f"no node {node_id}"
    return m.group(1)


def _text(dot_label: str) -> str:
    """An HTML-like label's visible text (tags dropped, entities decoded, spaces squeezed)."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dot_label)).split())


# -- the plan drawing -------------------------------------------------------------------------


def test_plan_drawing_has_a_table_per_part_with_every_collective():
    dot = viz.to_dot(_plan(), which="plan")
    fwd = _node_attrs(dot, "g0_collectives_forward")
    bwd = _node_attrs(dot, "g0_collectives_backward")
    text = _text(fwd)
    assert "forward collectives · 2 collectives, 1 compressed" in text
    assert "c0 all_reduce (sum) 2 ranks, group 0 4×16 float32 int8 256 B → 72 B" in text
    # the collective left alone: codec none, raw bytes on the wire, and why (escaped)
    assert "c1 all_reduce (max) 2 ranks, group 0 4×16 float32 none 256 B → 256 B" in text
    assert f"left alone: {REASON}" in text and "&lt;&amp;&gt;" in fwd
    assert "per call 512 B → 328 B (×0.641)" in text
    assert "c2 reduce_scatter (sum)" in _text(bwd) and "int4:ef" in _text(bwd)
    assert "c0" not in _text(bwd)  # each part its own table
    # a compressed one makes the table the codec's orange; placed under the stage
    assert f'fillcolor="{CODEC_FILL}"' in fwd and 'shape="cds"' in fwd
    assert '"g0_stage0" -> "g0_collectives_forward" [style="invis"]' in dot
    assert "ccfx plan · 1 stages · activations none · collectives int8" in dot
    assert _acyclic(_edges(dot))


def test_plan_drawing_greys_a_table_with_nothing_compressed_and_adds_nothing_without():
    dot = viz.to_dot(_plan(_rows()[1:2]), which="plan")
    attrs = _node_attrs(dot, "g0_collectives_forward")
    assert f'fillcolor="{KEPT_FILL}"' in attrs and CODEC_FILL not in attrs
    assert "collectives_backward" not in dot
    assert "collectives" not in viz.to_dot(_plan([]), which="plan")


@pytest.mark.skipif(not HAS_DOT, reason="graphviz's dot is not installed")
def test_plan_drawing_renders_the_table():
    svg = viz.svg_text(viz.to_dot(_plan(), which="plan"))
    texts = [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]
    assert "256 B → 72 B" in texts and "int4:ef" in texts
    assert any(REASON in t for t in texts)


# -- a compressed collective in a forward graph (a view built by hand) --------------------------


def _view() -> GraphView:
    """x → matmul → [the all-reduce's compressed form: 3 spliced nodes and a state
    placeholder] → relu → output."""
    gp = _plan().graphs[0]
    nodes = [
        VNode("x", "input", 0, (), "placeholder", (4, 16), "float32"),
        VNode("mm", "op", 0, ("lin",), "mm", (4, 16), "float32", flops=100, inputs=["x"]),
        VNode("cstate", "collective", 0, (), "placeholder", (16,), "float32", collective=0),
        VNode("enc", "op", 0, (), "encode", (72,), "uint8", inputs=["mm", "cstate"]),
        VNode("a2a", "op", 0, (), "all_to_all", (72,), "uint8", inputs=["enc"]),
        VNode("dec", "op", 0, (), "decode", (4, 16), "float32", inputs=["a2a"]),
        VNode("relu", "op", 0, ("lin",), "relu", (4, 16), "float32", inputs=["dec"]),
        VNode("pg", "object", 0, (), "placeholder", (), "FakeScriptObject"),  # a group handle
        VNode("output", "output", 0, (), "output", inputs=["relu", "pg"]),
    ]
    for v in nodes[2:6]:
        v.kind, v.collective = "collective", 0
    return GraphView(0, "forward", nodes, gp, "flops")


@pytest.mark.parametrize("depth", [None, 2])
def test_a_compressed_collective_is_one_orange_node_with_codec_and_bytes(depth):
    dot = graph_dot([_view()], depth)
    attrs = _node_attrs(dot, "g0_collective0")
    assert "c0 · all_reduce (sum) · int8" in attrs and "256 B → 72 B per call" in attrs
    assert f'fillcolor="{CODEC_FILL}"' in attrs
    assert len(re.findall(r'^\s*"g0_collective0" \[', dot, flags=re.MULTILINE)) == 1
    assert '"g0_pg"' not in dot  # a process group handle is not data: not drawn
    for spliced in ("enc", "a2a", "dec", "cstate"):  # folded into the one node
        assert f'"g0_{spliced}"' not in dot
    edges = _edges(dot)
    assert sum(h == "g0_collective0" for _, h in edges) == 1  # matmul in, relu out
    assert sum(t == "g0_collective0" for t, _ in edges) == 1
    assert re.search(r'-> "g0_collective0" \[label="c0", color="#e69138"', dot)
    assert _acyclic(edges)


# -- a real compile: a gloo group of one, the user's funcol all-reduce ---------------------------


class FuncolMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol

        h = funcol.all_reduce(self.a(x), "sum", dist.group.WORLD)
        return self.b(h.relu())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A model compiled with collective_codec int8 under a group of one rank, 2 steps."""
    with util.group_of_one(tmp_path_factory.mktemp("pg")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        compiled = torch.compile(FuncolMLP(), backend="ccfx",
                                 options={"lowering": "eager", "collective_codec": "int8"})
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
        yield compiled
    torch._dynamo.reset()


def test_forward_and_backward_drawings_show_the_collective_left_alone_and_why(one_rank):
    plan = ccfx.plan_of(one_rank)
    assert [(c.index, c.part, c.codec) for c in plan.collectives] == [
        (0, "forward", "none"), (1, "backward", "none")]
    for which, index in (("forward", 0), ("backward", 1)):
        for depth in (None, 2):
            dot = viz.to_dot(one_rank, which=which, depth=depth)
            attrs = _node_attrs(dot, f"g0_collective{index}")
            assert f"· collectives int8 · {'every node' if depth is None else 'modules'}" in dot
            assert f"c{index} · all_reduce (sum) · none" in attrs
            assert "left alone: collective_codec='int8' refused: a group of one" in attrs
            assert f'fillcolor="{KEPT_FILL}"' in attrs
            assert "all_reduce\\nall_reduce" not in dot  # not also drawn as a plain op
            edges = _edges(dot)
            assert any(h == f"g0_collective{index}" for _, h in edges)
            assert any(t == f"g0_collective{index}" for t, _ in edges)
            assert _acyclic(edges), (which, depth)  # a box around it is split, not a cycle
    part = viz.to_dot(one_rank)  # the partitioned graph: the tables beside it
    assert "g0_collectives_forward" in part and "g0_collectives_backward" in part


def test_report_lists_every_collective_with_the_ledgers_calls(one_rank, tmp_path):
    page = report_html(one_rank)
    assert "<h2>Collectives</h2>" in page
    rows = re.findall(r"<tr>(.*?)</tr>", page.split("<h2>Collectives</h2>")[1])
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows]
    cells = [c for c in cells if len(c) == 13]
    assert [c[1:4] for c in cells] == [["c0", "forward", "all_reduce (sum)"],
                                       ["c1", "backward", "all_reduce (sum)"]]
    assert [c[11] for c in cells] == ["2", "2"]  # two steps, counted by the ledger
    assert all("a group of one" in c[12] for c in cells)
    assert "collectives (compressed / all)" in page and "0 / 2" in page
    assert "ccfx report · 2 collectives · collective codec int8" in page


def test_report_cards_say_what_compression_saves_per_step():
    page = report_html(_plan())
    cards = {html.unescape(k): html.unescape(v) for v, k in re.findall(
        r'<div class="card"><b>([^<]*)</b><span>([^<]*)</span></div>', page)}
    assert cards["collectives (compressed / all)"] == "2 / 3"
    assert cards["collective bytes per rank per step, raw → wire"] == "768 B → 368 B"
    assert cards["collective bytes saved per rank per step"] == "400 B"
    assert cards["collective saving (raw / wire)"] == "2.1×"
    section = page.split("<h2>Collectives</h2>")[1]
    assert "<b>int4:ef</b>" in section and html.escape(REASON) in section
    assert "Bytes per call per collective" in section
    # no collectives: no section, no cards
    bare = report_html(_plan([]))
    assert "Collectives</h2>" not in bare and "collective saving" not in bare


@pytest.mark.skipif(not HAS_DOT, reason="graphviz's dot is not installed")
def test_report_with_collectives_in_headless_chromium(one_rank, tmp_path):
    check = _browser_check()
    if check.find_browser() is None:
        pytest.skip("no Chromium: apt-get install -y chromium")
    path = viz.write_report(tmp_path / "r.html", one_rank)
    result = check.check_html(path)
    assert result["errors"] == [] and result["external_requests"] == []
    assert result["drawings_ok"], result["drawings"]
    assert any("forward collectives" in d.get("text", "") for d in result["drawings"])
    assert result["ok"]


def test_cli_reads_a_plan_json_with_collectives(tmp_path, capsys):
    from ccfx import cli

    path = tmp_path / "plan.json"
    path.write_text(_plan().to_json())
    assert cli.main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Collectives</h2>" in page and "collective bytes saved per rank per step" in page
    assert cli.main(["viz", str(path), "-o", str(tmp_path / "p.dot")]) == 0
    assert "g0_collectives_backward" in (tmp_path / "p.dot").read_text()
    assert "wrote" in capsys.readouterr().out


def test_titles_and_cards_name_the_overrides_by_kind():
    plan = _plan()
    plan.config["collective_overrides"] = {"reduce_scatter": "int4:ef", "collective 1": "none"}
    said = "int8 (collective 1: none, reduce_scatter: int4:ef)"
    assert f"· collectives {said}" in viz.to_dot(plan)
    page = report_html(plan)
    assert f"<title>ccfx report · 3 collectives · collective codec {said}</title>" in page
    assert f"<b>{said}</b><span>collective codec</span>" in page


def test_a_process_group_handle_placeholder_is_an_object_not_an_input():
    from ccfx.viz.view import _is_object

    class FakeScriptObject:  # what a ProcessGroup input of ccfx.shard's graphs is while traced
        pass

    assert _is_object(FakeScriptObject()) and not _is_object(torch.ones(1))
    assert not _is_object(3) and not _is_object(None)


def test_a_per_row_collective_shows_bytes_per_row_and_stays_out_of_per_call_totals():
    # an expert all-to-all whose row count is data-dependent: bytes per row, not per call
    a2a = Collective(0, 3, "forward", "all_to_all", "0", 2, ["u2+u3", 16], "torch.float32",
                     "int8", 64, 20, per_row=True)
    page = report_html(_plan([*_rows(), a2a]))
    cards = {html.unescape(k): html.unescape(v) for v, k in re.findall(
        r'<div class="card"><b>([^<]*)</b><span>([^<]*)</span></div>', page)}
    assert cards["collective bytes per rank per step, raw → wire"] == "768 B → 368 B"  # as before
    section = page.split("<h2>Collectives</h2>")[1]
    assert "64 B/row" in section and "20 B/row" in section
    only = report_html(_plan([a2a]))  # nothing per call: no bar chart
    assert "Bytes per call per collective" not in only.split("<h2>Collectives</h2>")[1]
    assert bytes_text(a2a) == "64 B → 20 B per row"
