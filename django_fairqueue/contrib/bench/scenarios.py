"""Every scenario of ``manage.py fairbench``, and the names the command uses.

Scenarios are small modules (``enqueue``, ``claim``, ``latency``, ``fairness``, ``timeshare``,
``snapshot``, ``schedules``, ``functions``, ``groups`` (with ``sybil``), ``enqueue_cost``,
``admin``, ``e2e`` and ``pickup``; the last two through real ``runfairworker`` processes),
each a plan of cells and a function that runs one cell and returns a frozen dataclass;
``runner.run`` runs them on one database and returns a
:class:`~django_fairqueue.contrib.bench.report.Report` (tables, JSON, targets). See
``scenario.py`` for how to add one, and docs/performance.md for figures.
"""

from __future__ import annotations

from django_fairqueue.contrib.bench import (
    admin_render,
    claim,
    e2e,
    enqueue,
    enqueue_cost,
    fairness,
    functions,
    groups,
    latency,
    pickup,
    plots,
    schedules,
    snapshot,
    timeshare,
)
from django_fairqueue.contrib.bench.harness import BenchmarkError, Progress
from django_fairqueue.contrib.bench.scenario import Scenario
from django_fairqueue.contrib.bench.sizes import PRESETS, Sizes

#: Every scenario, in the order a full run performs them.
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        enqueue.SCENARIO,
        claim.SCENARIO,
        latency.SCENARIO,
        fairness.SCENARIO,
        timeshare.SCENARIO,
        snapshot.SCENARIO,
        schedules.SCENARIO,
        functions.SCENARIO,
        groups.SCENARIO,
        groups.SYBIL,
        enqueue_cost.SCENARIO,
        admin_render.SCENARIO,
        e2e.SCENARIO,
        pickup.SCENARIO,
    )
}

__all__ = ["PRESETS", "SCENARIOS", "BenchmarkError", "Progress", "Scenario", "Sizes", "plots"]
