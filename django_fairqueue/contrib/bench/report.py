"""Results: plain-text tables, the JSON document, and the issue's targets checked against them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue.contrib.bench.scenario import Scenario

#: Bump when the JSON layout changes incompatibly.
SCHEMA_VERSION = 1
#: Other processes using this many cores during a cell make its figures noise.
NOISY_CORES = 0.5


@dataclass
class ScenarioReport:
    scenario: Scenario
    results: list[Any] = field(default_factory=list)
    #: Per cell: CPU cores other processes used meanwhile (harness.CpuWatch), None if unknown.
    others_cpu: list[float | None] = field(default_factory=list)
    wall_seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "title": self.scenario.title,
            "wall_seconds": round(self.wall_seconds, 1),
            "notes": list(self.scenario.notes),
            "cells": [
                {**dataclasses.asdict(r), "others_cpu": cpu}
                for r, cpu in zip(self.results, self._others(), strict=True)
            ],
        }

    def _others(self) -> list[float | None]:
        return self.others_cpu + [None] * (len(self.results) - len(self.others_cpu))


@dataclass(frozen=True)
class TargetCheck:
    name: str
    target: str
    measured: str
    met: bool

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Report:
    meta: dict[str, Any]
    scenarios: dict[str, ScenarioReport] = field(default_factory=dict)
    targets: list[TargetCheck] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "meta": self.meta,
            "scenarios": {name: s.as_json() for name, s in self.scenarios.items()},
            "targets": [t.as_json() for t in self.targets],
        }


def table(report: ScenarioReport, baseline: dict[str, Any] | None = None) -> str:
    """The scenario's results as an aligned plain-text table, with its notes underneath.

    With ``baseline`` (an earlier run's JSON), two columns compare each cell's main figure.
    """
    scenario = report.scenario
    columns = list(scenario.columns)
    rows = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in report.results]
    rows[0].append("others")
    for row, cpu in zip(rows[1:], report._others(), strict=True):
        row.append("-" if cpu is None else f"{cpu:.2f}" + ("!" if cpu >= NOISY_CORES else ""))
    earlier = _baseline_figures(scenario, baseline)
    if earlier is not None:
        metric = next(c for c in columns if c.attr == scenario.metric)
        rows[0] += [f"base {metric.header}", "change"]
        for row, result in zip(rows[1:], report.results, strict=True):
            before = earlier.get(tuple(getattr(result, k) for k in scenario.key))
            now = getattr(result, scenario.metric)
            if before is None or not before:
                row += ["-", "-"]
                continue
            row += [format(before, metric.spec), f"{100 * (now - before) / before:+.0f}%"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            # text columns left-aligned, figures right-aligned
            cell.ljust(w) if i == 0 and not _numeric(cell) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    out = [scenario.title, "=" * len(scenario.title), line(rows[0])]
    out.append("  ".join("-" * w for w in widths))
    out += [line(row) for row in rows[1:]]
    out += [f"  * {note}" for note in scenario.notes]
    out.append(
        "  * others: CPU cores other processes on this machine used during the cell (at least); "
        f"! marks {NOISY_CORES} or more: that cell's figures are not comparable."
    )
    if earlier is not None:
        better = "higher" if scenario.higher_is_better else "lower"
        out.append(f"  * change: against the baseline run ({better} is better).")
    return "\n".join(out)


def _baseline_figures(
    scenario: Scenario, baseline: dict[str, Any] | None
) -> dict[tuple[Any, ...], float | None] | None:
    if baseline is None or not scenario.key:
        return None
    cells = baseline.get("scenarios", {}).get(scenario.name, {}).get("cells", [])
    return {
        tuple(cell.get(k) for k in scenario.key): cell.get(scenario.metric)
        for cell in cells
        if isinstance(cell, dict)
    }


def targets_table(checks: Sequence[TargetCheck]) -> str:
    title = "Targets"
    width = max([len(c.name) for c in checks] + [6])
    target_width = max([len(c.target) for c in checks] + [6])
    out = [title, "=" * len(title)]
    for c in checks:
        verdict = "met" if c.met else "MISSED"
        out.append(f"{c.name:<{width}}  {c.target:<{target_width}}  {c.measured}  {verdict}")
    return "\n".join(out)


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text[0] in "-.")


# --------------------------------------------------------------------------------------------
# Targets


def check_targets(report: Report) -> list[TargetCheck]:
    """The issue's targets that this run measured (a scenario not run checks nothing)."""
    checks: list[TargetCheck] = []
    for rule in _RULES:
        check = rule(report)
        if check is not None:
            checks.append(check)
    return checks


def _cells(report: Report, scenario: str) -> list[Any]:
    found = report.scenarios.get(scenario)
    return found.results if found is not None else []


def _enqueue_batch(report: Report) -> TargetCheck | None:
    cells = [c for c in _cells(report, "enqueue") if c.mode == "batch"]
    if not cells:
        return None
    best = max(cells, key=lambda c: c.rate)
    return TargetCheck(
        "enqueue, batch of 100",
        ">= 40,000 messages/s",
        f"{best.rate:,.0f}/s ({best.processes} process{'es' if best.processes > 1 else ''})",
        best.rate >= 40_000,
    )


def _claim_rule(channels_many: bool, batch: int, floor: float, name: str) -> Callable[..., Any]:
    def rule(report: Report) -> TargetCheck | None:
        cells = [
            c
            for c in _cells(report, "claim")
            if c.batch == batch and (c.channels > 1) == channels_many
        ]
        if not cells:
            return None
        best = max(cells, key=lambda c: c.rate)
        return TargetCheck(
            name,
            f">= {floor:,.0f} messages/s",
            f"{best.rate:,.0f}/s ({best.claimers} claimer{'s' if best.claimers > 1 else ''}, "
            f"{getattr(best, 'mode', 'separate')})",
            best.rate >= floor,
        )

    return rule


def _latency_flat(series: str, name: str) -> Callable[[Report], TargetCheck | None]:
    def rule(report: Report) -> TargetCheck | None:
        cells = [c for c in _cells(report, "latency") if c.series == series]
        if len(cells) < 2:
            return None
        first, last = cells[0], cells[-1]
        ratio = last.claim_p50_ms / first.claim_p50_ms if first.claim_p50_ms else math.inf
        what = "backlog" if series == "backlog" else "channels"
        return TargetCheck(
            name,
            "p50 within 2x",
            f"{first.claim_p50_ms:.2f} -> {last.claim_p50_ms:.2f} ms "
            f"({ratio:.2f}x, {getattr(first, what):,} -> {getattr(last, what):,} {what})",
            ratio <= 2.0,
        )

    return rule


def _fairness(report: Report) -> TargetCheck | None:
    cells = _cells(report, "fairness")
    if not cells:
        return None
    # "Within a few claims": the claims B's burst needs at its fair share (half of each batch
    # with two active channels), plus one claim already in flight per process.
    worst = max(cells, key=lambda c: c.claims_before_b_max - _claims_allowed(c))
    allowed = _claims_allowed(worst)
    return TargetCheck(
        "B's burst served within a few claims",
        "<= claims at a fair share + 1 per process",
        f"{worst.claims_before_b_max} claims at most (allowed {allowed}), "
        f"p99 {max(c.b_wait_p99_ms for c in cells):.1f} ms",
        all(c.claims_before_b_max <= _claims_allowed(c) for c in cells),
    )


def _claims_allowed(cell: Any) -> int:
    allowed: int = math.ceil(cell.burst / max(1, cell.batch // 2)) + cell.processes
    return allowed


def _fairness_backlog_independent(report: Report) -> TargetCheck | None:
    cells = _cells(report, "fairness")
    backlogs = sorted({c.a_backlog for c in cells})
    if len(backlogs) < 2:
        return None
    small = max(c.b_wait_p99_ms for c in cells if c.a_backlog == backlogs[0])
    large = max(c.b_wait_p99_ms for c in cells if c.a_backlog == backlogs[-1])
    return TargetCheck(
        "B's p99 independent of A's backlog",
        "within 2x (or 5 ms)",
        f"{small:.1f} ms at {backlogs[0]:,} -> {large:.1f} ms at {backlogs[-1]:,}",
        large <= max(2 * small, small + 5),
    )


def _fairness_p99(report: Report) -> TargetCheck | None:
    cells = _cells(report, "fairness")
    if not cells:
        return None
    worst = max(cells, key=lambda c: c.b_wait_p99_ms)
    return TargetCheck(
        "B's p99 wait",
        "< 50 ms",
        f"{worst.b_wait_p99_ms:.1f} ms (A backlog {worst.a_backlog:,}, {worst.processes} proc)",
        worst.b_wait_p99_ms < 50,
    )


def _e2e(report: Report) -> TargetCheck | None:
    cells = [c for c in _cells(report, "e2e") if c.channels > 1]
    if not cells:
        return None
    best = max(cells, key=lambda c: c.rate)
    return TargetCheck(
        f"end-to-end no-op tasks, {best.channels} channels",
        ">= 8,000 tasks/s",
        f"{best.rate:,.0f}/s ({best.processes} proc x {best.threads} threads"
        + (f", prefetch {best.prefetch})" if best.prefetch else ")"),
        best.rate >= 8_000,
    )


def _pickup(report: Report) -> TargetCheck | None:
    cells = [c for c in _cells(report, "pickup") if c.mode == "listen"]
    if not cells:
        return None
    cell = cells[0]
    return TargetCheck(
        "pickup latency with LISTEN, p50",
        "<= 5 ms",
        f"{cell.p50_ms:.2f} ms (p99 {cell.p99_ms:.2f} ms)",
        cell.p50_ms <= 5.0,
    )


def _admin(report: Report) -> TargetCheck | None:
    cells = _cells(report, "admin")
    if not cells:
        return None
    worst = max(cells, key=lambda c: c.median_ms)
    return TargetCheck(
        f"every admin page, {worst.messages:,} messages / {worst.channels:,} channels",
        "<= 300 ms (median)",
        f"slowest {worst.median_ms:.0f} ms ({worst.page}); "
        f"{sum(not c.under_target for c in cells)} of {len(cells)} pages over",
        all(c.under_target for c in cells),
    )


def _sybil(report: Report) -> TargetCheck | None:
    # the target holds for tenants as channel groups; as 101 channels bob gets 100 turns
    # to alice's one, by design (the notes of the scenario's table say so)
    cells = [c for c in _cells(report, "sybil") if c.grouped]
    if not cells:
        return None
    worst = max(cells, key=lambda c: c.wait_p99_ms)
    return TargetCheck(
        "alice's p99 behind a sybil bob, grouped",
        "<= 50 ms",
        f"{worst.wait_p99_ms:.1f} ms (bob's backlog {worst.backlog:,} in 100 channels)",
        worst.wait_p99_ms <= 50,
    )


_RULES: list[Callable[[Report], TargetCheck | None]] = [
    _enqueue_batch,
    _claim_rule(True, 100, 15_000, "claim+complete, batch 100, many channels"),
    _claim_rule(False, 100, 20_000, "claim+complete, batch 100, 1 hot channel"),
    _claim_rule(True, 1, 1_000, "claim+complete, batch 1, many channels"),
    _claim_rule(False, 1, 1_000, "claim+complete, batch 1, 1 channel"),
    _latency_flat("backlog", "claim latency vs backlog"),
    _latency_flat("channels", "claim latency vs channels"),
    _fairness,
    _fairness_backlog_independent,
    _fairness_p99,
    _e2e,
    _pickup,
    _sybil,
    _admin,
]
