"""A scenario: a plan of cells, how to run one cell, and how to show the results as a table.

To add a scenario (``e2e.py`` and ``pickup.py`` are recent examples): write a module with
a frozen ``*Cell`` dataclass, a frozen ``*Result`` dataclass, ``plan(sizes) -> list[Cell]`` and
``run(bench, cell) -> Result``, build a :class:`Scenario` and add it to
``django_fairqueue.contrib.bench.SCENARIOS``. The runner, the table, the JSON and ``--scenario``
pick it up from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from django_fairqueue.contrib.bench.harness import Bench
from django_fairqueue.contrib.bench.sizes import Sizes

#: The note under a table with a ``spread %`` column (figures.spread_pct).
SPREAD_NOTE = (
    "spread %: with --repeat N, (the fastest run's rate - the slowest's) / the median rate, "
    "in %: how far the runs fell apart; - after a single run."
)


@dataclass(frozen=True)
class Column:
    header: str
    attr: str
    #: ``format()`` spec for the value, e.g. ``",.0f"``; ``None`` is printed as ``-``.
    spec: str = ""

    def cell(self, result: Any) -> str:
        value = getattr(result, self.attr)
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else ""
        return format(value, self.spec)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    plan: Callable[[Sizes], Sequence[Any]]
    run: Callable[[Bench, Any], Any]
    columns: Sequence[Column]
    #: One short phrase for the progress line of a finished cell.
    summary: Callable[[Any], str]
    #: Result fields that identify a cell across runs (for --baseline), and its main figure.
    key: Sequence[str] = ()
    metric: str = ""
    higher_is_better: bool = True
    #: Fills fields that compare cells (e.g. latency relative to the smallest backlog).
    finish: Callable[[list[Any]], list[Any]] | None = None
    #: Printed under the table: what was measured and how.
    notes: Sequence[str] = field(default_factory=tuple)
    #: Checked on the benchmark's database before any cell runs: why the scenario cannot run
    #: there (a server too old, a privilege missing), or None. A scenario that cannot run is
    #: skipped with a warning, rather than failing the run after minutes of other scenarios.
    unavailable: Callable[[str], str | None] | None = None


def relative_to_first(results: list[Any], *, group: str, value: str, into: str) -> list[Any]:
    """Each result (a frozen dataclass) with ``into`` set to its ``value`` over the ``value`` of
    the first result of its ``group`` in run order (None when that is 0): a scenario's
    ``finish`` for "x first" columns."""
    first: dict[Any, float] = {}
    out = []
    for r in results:
        base = first.setdefault(getattr(r, group), getattr(r, value))
        ratio = round(getattr(r, value) / base, 2) if base else None
        out.append(replace(r, **{into: ratio}))
    return out
