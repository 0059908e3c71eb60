"""Tables, goals and plots of a comparison run (its JSON document)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django_fairqueue.contrib.bench.plots import Chart, Series, line_chart

US = "django-fairqueue"
FLOOR = "raw-sql"
#: django-fairqueue at an earlier commit (``--baseline``): compared with, never a peer.
BASELINE = "django-fairqueue-baseline"


def _is_peer(name: str, of: str) -> bool:
    """Whether system ``name`` counts among the other systems ``of`` is compared with: not
    itself, not the floor, and no version of django-fairqueue for django-fairqueue."""
    return name not in (of, FLOOR) and not (of.startswith(US) and name.startswith(US))


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(header)] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "=" * len(title)]
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["system"]: s for s in doc["systems"]}


def _enqueue(system: dict[str, Any], mode: str, processes: int) -> float | None:
    """The cell's rate (with several enqueue rounds: its median over them)."""
    return _cell_rate(system["enqueue"], mode, processes)


def _cell_rate(cells: Sequence[dict[str, Any]], mode: str, processes: int) -> float | None:
    for c in cells:
        if c["mode"] == mode and c["processes"] == processes:
            return float(c["rate"])
    return None


def _round_rates(system: dict[str, Any], mode: str, processes: int) -> list[float | None]:
    """The cell's rate in each enqueue round, None where the system did not run that round.
    A run without rounds is one round."""
    rounds = system.get("enqueue_rounds") or [system.get("enqueue") or None]
    return [None if cells is None else _cell_rate(cells, mode, processes) for cells in rounds]


def enqueue_ratios(
    system: dict[str, Any], bases: Sequence[dict[str, Any]], mode: str, processes: int
) -> list[float]:
    """The system's rate over the best of ``bases`` in the same enqueue round, for every round
    all of them ran. Rounds alternate the systems a few seconds apart, so a ratio compares
    cells measured under the same load; a rate compared across rounds would not."""
    ours = _round_rates(system, mode, processes)
    theirs = [_round_rates(b, mode, processes) for b in bases]
    ratios = []
    for n, rate in enumerate(ours):
        others = [t[n] for t in theirs if n < len(t) and t[n] is not None]
        if rate is not None and others and max(others) > 0:  # type: ignore[type-var]
            ratios.append(rate / max(others))  # type: ignore[type-var]
    return ratios


def _ratios_text(ratios: Sequence[float]) -> str | None:
    """The median ratio; with several rounds also their range: ``0.62 (0.55-0.70)``."""
    if not ratios:
        return None
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _best(system: dict[str, Any]) -> dict[str, Any]:
    return max(system["e2e"], key=lambda c: c["rate"])


def _others(cell: dict[str, Any]) -> str | None:
    """CPU cores other processes used during the cell; ! from 0.5 (not comparable)."""
    cpu = cell.get("others_cpu")
    return None if cpu is None else f"{cpu:.2f}" + ("!" if cpu >= 0.5 else "")


def _ratio(value: float | None, base: float | None) -> str | None:
    if value is None or not base:
        return None
    return f"{value / base:.2f}"


def tables(doc: dict[str, Any]) -> str:
    systems = _by_name(doc)
    floor = systems.get(FLOOR)
    out = []
    procs = sorted({c["processes"] for s in systems.values() for c in s.get("enqueue") or []})
    if procs:
        out += _enqueue_tables(systems, floor, procs)
    if any(s.get("e2e") for s in systems.values()):
        out += _e2e_tables(systems, floor)
    if any(s.get("pickup") for s in systems.values()):
        out.append(_pickup_table(systems))
    if any(s.get("fairness") for s in systems.values()):
        out.append(_fairness_table(systems))
    if any(s.get("timeshare") for s in systems.values()):
        out.append(_timeshare_table(systems))
    if doc.get("goals"):
        rows = [[g["goal"], g["measured"], "met" if g["met"] else "MISSED"] for g in doc["goals"]]
        out.append(_table("Goals", ["goal", "measured", "verdict"], rows))
    return "\n\n".join(out)


def _enqueue_tables(
    systems: dict[str, dict[str, Any]], floor: dict[str, Any] | None, procs: list[int]
) -> list[str]:
    """The rates, then each system's ratios to the floor and to the fastest of the others."""
    header = ["system"]
    for mode in ("single", "batch"):
        header += [f"{mode} x{p}" for p in procs]
    rows = []
    for name, s in systems.items():
        if not s.get("enqueue"):
            continue
        row: list[Any] = [name]
        for mode in ("single", "batch"):
            row += [f"{r:,.0f}" if (r := _enqueue(s, mode, p)) is not None else None for p in procs]
        rows.append(row)
    rates = _table("Enqueue (jobs/s; batch = 100 jobs of one tenant per transaction)", header, rows)

    rows = []
    for name, s in systems.items():
        if not s.get("enqueue") or name == FLOOR:
            continue
        peers = [p for n, p in systems.items() if _is_peer(n, name) and p.get("enqueue")]
        for processes in procs:
            row = [name, f"x{processes}"]
            for mode in ("single", "batch"):
                row.append(
                    _ratios_text(enqueue_ratios(s, [floor], mode, processes)) if floor else None
                )
            for mode in ("single", "batch"):
                row.append(_ratios_text(enqueue_ratios(s, peers, mode, processes)))
            rows.append(row)
    rounds = max((len(s.get("enqueue_rounds") or [1]) for s in systems.values()), default=1)
    title = "Enqueue ratios (to the raw floor; to the fastest other system, floor aside)"
    if rounds > 1:
        title += f": median of {rounds} rounds (range)"
    ratios = _table(
        title,
        ["system", "procs", "single/floor", "batch/floor", "single/peer", "batch/peer"],
        rows,
    )
    out = [rates, ratios]
    us, before = systems.get(US), systems.get(BASELINE)
    if us and before and us.get("enqueue") and before.get("enqueue"):
        rows = [
            [
                f"x{p}",
                *(_ratios_text(enqueue_ratios(us, [before], m, p)) for m in ("single", "batch")),
            ]
            for p in procs
        ]
        out.append(
            _table(
                f"{US} over {BASELINE} ({before['version']}), same rounds",
                ["procs", "single", "batch"],
                rows,
            )
        )
    return out


def _e2e_tables(systems: dict[str, dict[str, Any]], floor: dict[str, Any] | None) -> list[str]:
    out = []
    rows = []
    for name, s in systems.items():
        for c in s.get("e2e") or []:
            rows.append(
                [
                    name,
                    c["label"],
                    f"{c['rate']:,.0f}",
                    f"{c['drain_rate']:,.0f}",
                    f"{c['backlog']:,}",
                    f"{c['startup_s']:.1f}",
                    _others(c),
                    "best" if c["best"] else "",
                ]
            )
    out.append(
        _table(
            "End-to-end no-op jobs by processes x concurrency (jobs/s, 10%-90% of the backlog)",
            ["system", "P x C", "jobs/s", "drain jobs/s", "backlog", "start-up s", "others", ""],
            rows,
        )
    )
    rows = []
    floor_best = _best(floor)["rate"] if floor and floor.get("e2e") else None
    for name, s in systems.items():
        if not s.get("e2e"):
            continue
        b = _best(s)
        rows.append(
            [
                name,
                b["label"],
                f"{b['rate']:,.0f}",
                _ratio(b["rate"], floor_best),
                s["concurrency_unit"],
            ]
        )
    out.append(
        _table(
            "End-to-end, each system's best",
            ["system", "P x C", "jobs/s", "vs floor", "C is"],
            rows,
        )
    )
    return out


def _pickup_table(systems: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            s["pickup"]["p50_ms"],
            s["pickup"]["p90_ms"],
            s["pickup"]["p99_ms"],
            s["pickup"]["max_ms"],
            s["pickup"]["samples"],
            _others(s["pickup"]),
            s["wakeup"],
        ]
        for name, s in systems.items()
        if s.get("pickup")
    ]
    return _table(
        "Pickup latency, one idle worker (ms)",
        ["system", "p50", "p90", "p99", "max", "samples", "others", "wake-up"],
        rows,
    )


def _fairness_table(systems: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, s in systems.items():
        for c in s.get("fairness") or []:
            rows.append(
                [
                    name,
                    c["variant"],
                    f"{c['a_backlog']:,}",
                    c["workers"],
                    c["b_p50_ms"],
                    c["b_p99_ms"],
                    c["a_before_b_max"],
                    c["jain_min"],
                    f"{c['a_rate']:,.0f}",
                    c["rounds"],
                    c.get("note") or "",
                    _others(c),
                ]
            )
    return _table(
        "Fairness: A's backlog, then B's burst of 10 (B's wait in ms, handler start - commit)",
        [
            "system",
            "variant",
            "A backlog",
            "P x C",
            "B p50",
            "B p99",
            "A before B",
            "Jain",
            "A jobs/s",
            "rounds",
            "note",
            "others",
        ],
        rows,
    )


def _timeshare_table(systems: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, s in systems.items():
        for c in s.get("timeshare") or []:
            rows.append(
                [
                    name,
                    c["variant"],
                    f"{c['backlog']:,}",
                    c["workers"],
                    c["a_jobs"],
                    c["b_jobs"],
                    f"{c['a_time_share']:.2f} / {c['b_time_share']:.2f}",
                    c["jain_time"],
                    c["jain_count"],
                    c.get("note") or "",
                    _others(c),
                ]
            )
    table = _table(
        "Heavy against light: A's jobs take 200 ms, B's 5 ms, both backlogged",
        [
            "system",
            "variant",
            "backlog each",
            "P x C",
            "A jobs",
            "B jobs",
            "time A / B",
            "Jain time",
            "Jain count",
            "note",
            "others",
        ],
        rows,
    )
    return table + (
        "\n  * time A / B: shares of worker time (jobs started in the last 80 % of the window x "
        "their duration). No peer has weights or a charge by run time: weights 3:1 by time, "
        "and a tenant spread over many keys, are measured by fairbench's timeshare scenario "
        "for django-fairqueue only."
    )


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    systems = _by_name(doc)
    us = systems.get(US)
    if us is None:
        return []
    found = []
    peers = {n: s for n, s in systems.items() if _is_peer(n, US) and s.get("e2e")}
    if peers and us.get("e2e"):
        name, peer = max(peers.items(), key=lambda kv: _best(kv[1])["rate"])
        ours, theirs = _best(us)["rate"], _best(peer)["rate"]
        found.append(
            {
                "goal": "end-to-end >= 2x the fastest peer, while fair",
                "measured": f"{ours:,.0f} vs {theirs:,.0f}/s ({name}): {ours / theirs:.2f}x",
                "met": ours >= 2 * theirs,
            }
        )
    floor = systems.get(FLOOR)
    if floor and us.get("enqueue") and floor.get("enqueue"):
        top = max(c["processes"] for c in us["enqueue"])
        ours_b, raw_b = _enqueue(us, "batch", top), _enqueue(floor, "batch", top)
        if ours_b and raw_b:
            found.append(
                {
                    "goal": "enqueue batch >= 50% of the raw floor",
                    "measured": f"{ours_b:,.0f} vs {raw_b:,.0f}/s ({top} proc): "
                    f"{100 * ours_b / raw_b:.0f}%",
                    "met": ours_b >= 0.5 * raw_b,
                }
            )
    found += _enqueue_goals(us, floor, [s for n, s in systems.items() if _is_peer(n, US)])
    for c in us.get("fairness") or []:
        p99 = c["b_p99_ms"]
        found.append(
            {
                "goal": f"B's p99 < 50 ms with A's backlog {c['a_backlog']:,}",
                "measured": f"{p99} ms (p50 {c['b_p50_ms']} ms, Jain {c['jain_min']})",
                "met": p99 is not None and p99 < 50 and not c["timed_out"],
            }
        )
    return found


#: (mode, what it is compared with, least ratio): single-message and batch enqueue targets.
ENQUEUE_TARGETS = (
    ("single", "the raw floor", 0.6),
    ("single", "the fastest peer", 1.0),
    ("batch", "the fastest peer", 1.2),
)


def _enqueue_goals(
    us: dict[str, Any], floor: dict[str, Any] | None, peers: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each enqueue target at each process count, judged on the median same-round ratio."""
    peers = [p for p in peers if p.get("enqueue")]
    found: list[dict[str, Any]] = []
    if not us.get("enqueue"):
        return found
    for mode, against, least in ENQUEUE_TARGETS:
        bases = [floor] if against == "the raw floor" and floor and floor.get("enqueue") else []
        if against == "the fastest peer":
            bases = peers
        if not bases:
            continue
        for processes in sorted({c["processes"] for c in us["enqueue"]}):
            ratios = enqueue_ratios(us, bases, mode, processes)
            if not ratios:
                continue
            label = "one message" if mode == "single" else "batch of 100"
            found.append(
                {
                    "goal": f"enqueue {label}, {processes} proc, >= {least:g}x {against}",
                    "measured": f"{_ratios_text(ratios)}x over {len(ratios)} round(s)",
                    "met": statistics.median(ratios) >= least,
                }
            )
    return found


def plots(doc: dict[str, Any], directory: Path) -> list[Path]:
    systems = _by_name(doc)
    written: list[Path] = []
    series = [
        Series(
            name,
            [
                (c["processes"] * c["concurrency"], c["rate"])
                for c in sorted(s["e2e"], key=lambda c: c["processes"] * c["concurrency"])
            ],
        )
        for name, s in systems.items()
        if s.get("e2e")
    ]
    if series:
        written.append(
            line_chart(
                Chart(
                    title="End-to-end no-op jobs, same server, same run",
                    xlabel="processes x concurrency (threads, coroutines, batch size; log)",
                    ylabel="jobs/s (log)",
                    series=series,
                    logx=True,
                    logy=True,
                ),
                directory / "compare-e2e.png",
            )
        )
    rows = [
        (f"{name} ({c['variant']})", c)
        for name, s in systems.items()
        for c in s.get("fairness") or []
        if c["b_p99_ms"] is not None
    ]
    labels = sorted({label for label, _ in rows})
    series = [
        Series(label, sorted((c["a_backlog"], c["b_p99_ms"]) for lab, c in rows if lab == label))
        for label in labels
    ]
    if series:
        written.append(
            line_chart(
                Chart(
                    title="B's p99 wait for a burst of 10 behind A's backlog",
                    xlabel="A's backlog (jobs, log)",
                    ylabel="B's p99 wait (ms, log)",
                    series=series,
                    logx=True,
                    logy=True,
                    hline=(50.0, "goal: 50 ms"),
                ),
                directory / "compare-fairness.png",
            )
        )
    return written
