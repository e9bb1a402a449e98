"""The harness of every multi-rank test: ranks started by ccfx's own ``spawn``, many scenarios
per start, and the small pieces each rank's worker needs.

Starting ranks is what costs (each rank is a fresh process that imports torch and ccfx: seconds
each, more on a busy machine), so a test module starts its ranks once per world size, in a
module-scoped fixture, and runs every scenario in them; its tests then assert on parts of what
the ranks returned::

    @pytest.fixture(scope="module")
    def two():
        return ranks.run_scenarios(2, [ranks.scenario("train", w.train_steps, "int8", 4),
                                       ranks.scenario("resume", w.checkpoint_resume, ...)],
                                   timeout_s=300)

    @pytest.mark.slow
    def test_training_keeps_ranks_identical(two):
        r0, r1 = two["train"]                  # one value per rank, in rank order
        assert r0["params"] == r1["params"]

In the ranks, scenarios run one after the other (Dynamo reset between them). A scenario that
raises on a rank fails the tests that read it, with that rank's traceback; the rank then stops
(its peers may be waiting in a collective it will never join: they fail fast when its process
group goes away) and the later scenarios' tests fail saying which scenario failed first. Every
wait is bounded: the whole spawn by ``timeout_s``, each collective by ``pg_timeout_s``. A test
about how a failure itself is reported (a rank that dies, a rank that raises) calls
:func:`spawn` directly.

Rank-side helpers (:func:`digest`, :func:`rng`, :func:`gathered`, :func:`mean_over_ranks`,
:func:`params`, :func:`train`, :func:`caught`, :func:`raised`) are what the ``*_workers.py``
files share.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ccfx.runtime.launch import RankFailed, RankTimeout, spawn

__all__ = ["RankFailed", "RankTimeout", "Scenarios", "Shared", "SharedSpawns", "caught", "digest", "gathered",
           "mean_over_ranks", "params", "raised", "rng", "run_scenarios", "scenario", "spawn",
           "train"]


# -- in the parent ------------------------------------------------------------------------------


def scenario(name: str, fn: Callable[..., Any], *args, **kwargs) -> tuple:
    """One scenario: ``fn(rank, world, *args, **kwargs)`` on every rank (``fn`` module-level,
    picklable by name)."""
    return (name, fn, args, kwargs)


class Scenarios:
    """What :func:`run_scenarios` brought back: ``self[name]`` is one value per rank, or fails
    the calling test with the failing rank's message."""

    def __init__(self, world: int, per_rank: list[dict]):
        self.world = world
        self._per_rank = per_rank

    def __getitem__(self, name: str) -> list[Any]:
        rows = [r[name] for r in self._per_rank]
        failed = {rank: row for rank, row in enumerate(rows) if row[0] != "ok"}
        if failed:
            import pytest

            errors = {r: row for r, row in failed.items() if row[0] == "error"}
            first = min(errors or failed, key=lambda r: (failed[r][2], r))
            how = "failed first" if errors else "did not run it"
            lines = [f"scenario {name!r}: rank {first} of {self.world} {how}:"]
            for r, row in sorted(failed.items()):
                if r != first:
                    lines.append(f"  rank {r}: {row[1].splitlines()[0][:300]}")
            pytest.fail("\n".join(lines) + "\n" + failed[first][1], pytrace=False)
        return [row[1] for row in rows]

    def seconds(self, name: str) -> float:
        """The slowest rank's time in ``name`` (for deciding what to split or mark)."""
        return max(r[name][2] for r in self._per_rank if r[name][0] == "ok")

    def __repr__(self) -> str:
        names = list(self._per_rank[0]) if self._per_rank else []
        return f"Scenarios(world={self.world}, {names})"


def run_scenarios(world: int, scenarios: Iterable[tuple], *, timeout_s: float,
                  **spawn_options) -> Scenarios:
    """Start ``world`` ranks once and run every scenario in them, in order; ``spawn_options``
    go to :func:`spawn` (``grace_s``, ``pg_timeout_s``, ``env``). Raises what ``spawn`` raises
    when a rank dies or the deadline passes (every test of the fixture then errors with it)."""
    scenarios = list(scenarios)
    names = [s[0] for s in scenarios]
    assert len(set(names)) == len(names), f"scenario names repeat: {names}"
    return Scenarios(world, spawn(_run_scenarios, world, (scenarios,), timeout_s=timeout_s,
                                  **spawn_options))


class Shared:
    """A module's scenarios for the spawn that the modules of one world size share (conftest's
    ``shared_ranks``): starting ranks costs more the more there are (an empty spawn measured
    14 s for 4 ranks, 4 s for 2, on 2 busy cores), and each rank's first compile costs seconds
    more, so every module's 4-rank scenarios run in one 4-rank spawn, every module's 3-rank
    ones in one 3-rank spawn, and the 2-rank ones of the modules that break nothing on purpose
    in one 2-rank spawn. A module-level constant, read by the session before the first module
    asks::

        FOUR = ranks.Shared(4, [scenario("pp x dp", w.pipeline_dp, 2)], timeout_s=300)

        @pytest.fixture(scope="module")
        def four(shared_ranks):
            return shared_ranks[FOUR]        # this module's scenarios, by their own names

    Scenarios that need a folder are given as a function of pytest's ``tmp_path_factory``,
    called once, when the spawn starts::

        TWO = ranks.Shared(2, lambda tmp: [scenario("resume", w.resume,
                                                    str(tmp.mktemp("resume")))], timeout_s=300)

    The spawn runs the scenarios of every module with a selected ``slow`` test, module by
    module in name order; a scenario that fails stops its ranks, so the later modules' tests
    fail saying which scenario failed first (no scenario here breaks the group on purpose:
    those stay in their module's own spawn)."""

    def __init__(self, world: int, scenarios: Iterable[tuple] | Callable[[Any], Iterable[tuple]],
                 *, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        self._given = scenarios if callable(scenarios) else list(scenarios)
        self._made: list[tuple] | None = None

    def scenarios(self, tmp_path_factory) -> list[tuple]:
        """The scenarios (a function given for them called once, with ``tmp_path_factory``)."""
        if self._made is None:
            self._made = (list(self._given(tmp_path_factory)) if callable(self._given)
                          else self._given)
        return self._made


class SharedSpawns:
    """conftest's ``shared_ranks``: per world size, one spawn of every selected module's
    :class:`Shared` scenarios, started when a module first asks for it. A spawn that raises
    (a rank died, the deadline passed) is not started again for the next module: its error is
    raised again there, saying which module's setup started it."""

    def __init__(self, items: list, tmp_path_factory=None):
        modules = {getattr(i, "module", None) for i in items if i.get_closest_marker("slow")}
        self._declared = [(m.__name__.rpartition(".")[2], v)
                          for m in sorted(modules - {None}, key=lambda m: m.__name__)
                          for v in vars(m).values() if isinstance(v, Shared)]
        self._tmp = tmp_path_factory
        self._spawns: dict[int, Scenarios] = {}
        self._failed: dict[int, tuple[str, BaseException]] = {}

    def __getitem__(self, shared: Shared) -> _Prefixed:
        declared = [(name, d) for name, d in self._declared if d.world == shared.world]
        if not any(d is shared for _, d in declared):  # not known ahead: its own spawn
            return _Prefixed(run_scenarios(shared.world, shared.scenarios(self._tmp),
                                           timeout_s=shared.timeout_s), "")
        (name,) = [name for name, d in declared if d is shared]
        if shared.world in self._failed:
            first, error = self._failed[shared.world]
            raise RuntimeError(f"the shared {shared.world}-rank spawn (started by {first}'s "
                               f"setup) failed: {type(error).__name__}: {error}") from error
        if shared.world not in self._spawns:
            try:
                self._spawns[shared.world] = run_scenarios(
                    shared.world, [(f"{n}: {s[0]}", *s[1:]) for n, d in declared
                                   for s in d.scenarios(self._tmp)],
                    timeout_s=sum(d.timeout_s for _, d in declared))
            except Exception as e:
                self._failed[shared.world] = (name, e)
                raise
        return _Prefixed(self._spawns[shared.world], f"{name}: ")


class _Prefixed:
    """One module's part of a shared spawn: its scenarios by the names it gave them."""

    def __init__(self, scenarios: Scenarios, prefix: str):
        self._scenarios, self._prefix = scenarios, prefix
        self.world = scenarios.world

    def __getitem__(self, name: str) -> list[Any]:
        return self._scenarios[self._prefix + name]

    def seconds(self, name: str) -> float:
        return self._scenarios.seconds(self._prefix + name)


def _run_scenarios(rank: int, world: int, scenarios: list[tuple]) -> dict:
    """In each rank: name → ("ok", value, seconds) | ("error", traceback, when) |
    ("skipped", why, when)."""
    out: dict[str, tuple] = {}
    failed = None
    for name, fn, args, kwargs in scenarios:
        if failed is not None:
            out[name] = ("skipped", f"not run: scenario {failed!r} failed first on rank {rank}",
                         float("inf"))
            continue
        torch._dynamo.reset()
        start = time.monotonic()
        try:
            out[name] = ("ok", fn(rank, world, *args, **kwargs), time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 (reported to the tests that read this scenario)
            out[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                         time.time())
            failed = name
    return out


# -- in the ranks ---------------------------------------------------------------------------------


def digest(tensors: torch.Tensor | Iterable[torch.Tensor]) -> str:
    """A hash of the tensors' bytes (any dtype): equal digests, equal bits."""
    h = hashlib.sha256()
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rng(rank: int, step: int = 0, stride: int = 1000) -> torch.Generator:
    """The generator of one rank's data at one step (seed ``stride * rank + step``)."""
    return torch.Generator().manual_seed(stride * rank + step)


def gathered(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (raw), in group rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def mean_over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """The exact mean of ``t`` over the ranks (fp32 all-reduce, then a division)."""
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out / dist.get_world_size(group)


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's parameters, detached copies."""
    return [p.detach().clone() for p in module.parameters()]


def train(step_loss: Callable[[int], torch.Tensor], opt: torch.optim.Optimizer,
          steps: Iterable[int]) -> list[float]:
    """Per step ``i``: ``step_loss(i).backward()``, ``opt.step()``, ``opt.zero_grad()``; the
    losses."""
    losses = []
    for i in steps:
        loss = step_loss(i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def caught(fn: Callable[[], Any]) -> dict:
    """``fn()``'s error as data, for tests that assert on it: ``{"error": type name,
    "message": str, "elapsed": seconds}``, or ``{"error": None, "value": ..., "elapsed"}``."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 (the test asserts on the type and message)
        return {"error": type(e).__name__, "message": str(e),
                "elapsed": time.monotonic() - start}
    return {"error": None, "value": value, "elapsed": time.monotonic() - start}


def raised(rank: int, world: int, fn: Callable[..., Any], *args, **kwargs) -> str | None:
    """A scenario that must fail: ``fn(rank, world, *args, **kwargs)``'s error as
    ``"Type: message"`` (``None`` when it returned), so that later scenarios still run. Put it
    last when the failure leaves a peer waiting in a collective."""
    got = caught(lambda: fn(rank, world, *args, **kwargs))
    return None if got["error"] is None else f"{got['error']}: {got['message']}"
