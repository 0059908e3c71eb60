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


def e2e_ratios(system: dict[str, Any], base: dict[str, Any], label: str) -> list[float]:
    """The system's end-to-end rate in configuration ``label`` over ``base``'s in the same
    round, for every round both ran it (``--baseline``: the end-to-end cells in rounds)."""
    ours = [_e2e_rate(cells, label) for cells in system.get("e2e_rounds") or []]
    theirs = [_e2e_rate(cells, label) for cells in base.get("e2e_rounds") or []]
    return [a / b for a, b in zip(ours, theirs, strict=False) if a and b]


def _e2e_rate(cells: Sequence[dict[str, Any]] | None, label: str) -> float | None:
    return next((float(c["rate"]) for c in cells or [] if c["label"] == label), None)


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
    out += _baseline_tables(systems)
    if any(s.get("fairness") for s in systems.values()):
        out.append(_fairness_table(systems))
    if any(s.get("sybil") for s in systems.values()):
        out.append(_fairness_table(systems, "sybil"))
    if any(s.get("timeshare") for s in systems.values()):
        out.append(_timeshare_table(systems))
    if any(s.get("weights") for s in systems.values()):
        out.append(_timeshare_table(systems, "weights"))
    if any(s.get("bursts") for s in systems.values()):
        out.append(_bursts_table(systems))
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


def _baseline_tables(systems: dict[str, dict[str, Any]]) -> list[str]:
    """This checkout against ``--baseline``'s end to end (per configuration, the rates'
    medians and the ratio round by round) and at pickup (every round's samples pooled)."""
    us, before = systems.get(US), systems.get(BASELINE)
    if not us or not before:
        return []
    out = []
    rows = []
    for cell in us.get("e2e") or []:
        theirs = next((c for c in before.get("e2e") or [] if c["label"] == cell["label"]), None)
        if theirs is None:
            continue
        rows.append(
            [
                cell["label"],
                f"{cell['rate']:,.0f}",
                f"{theirs['rate']:,.0f}",
                _ratios_text(e2e_ratios(us, before, cell["label"])),
                cell.get("rounds", 1),
            ]
        )
    if rows:
        out.append(
            _table(
                f"End to end, {US} over {BASELINE} ({before['version']}), same rounds "
                "(jobs/s: medians; ratio: median of the rounds' (range))",
                ["P x C", US, BASELINE, "ratio", "rounds"],
                rows,
            )
        )
    if us.get("pickup") and before.get("pickup"):
        rows = [
            [name, s["pickup"]["p50_ms"], s["pickup"]["p99_ms"], s["pickup"]["samples"]]
            for name, s in ((US, us), (BASELINE, before))
        ]
        out.append(
            _table(
                f"Pickup, {US} and {BASELINE}, every round's samples pooled (ms)",
                ["system", "p50", "p99", "samples"],
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


def _wait(cell: dict[str, Any], key: str) -> str | None:
    """B's wait; a round given up is at least its timeout."""
    value = cell.get(key)  # b_max_ms: not in runs before 26 November 2026
    if cell.get("timed_out") and value is None:
        return f"> {cell.get('timeout_s', 0) * 1000:,.0f}"
    return None if value is None else f"{value:,}"


FAIRNESS_TITLES = {
    "fairness": "(a) One flood: A's backlog, then B's bursts of 10 (B's wait in ms, handler "
    "start - commit)",
    "sybil": "(b) Sybil: A's backlog spread over many keys (channels of its group, locks, "
    "entrypoints), then B's bursts of 10 in one key of hers (B's wait in ms)",
}


def _fairness_table(systems: dict[str, dict[str, Any]], scenario: str = "fairness") -> str:
    rows = []
    for name, s in systems.items():
        for c in s.get(scenario) or []:
            rows.append(
                [
                    name,
                    c["variant"],
                    f"{c['a_backlog']:,}",
                    c.get("a_keys", 1),
                    c["workers"],
                    _wait(c, "b_p50_ms"),
                    _wait(c, "b_p99_ms"),
                    _wait(c, "b_max_ms"),
                    c["a_before_b_max"],
                    c["jain_min"],
                    f"{c['a_rate']:,.0f}",
                    c["rounds"],
                    c.get("note") or "",
                    c.get("load1"),
                    _others(c),
                ]
            )
    return _table(
        FAIRNESS_TITLES[scenario],
        [
            "system",
            "variant",
            "A backlog",
            "A keys",
            "P x C",
            "B p50",
            "B p99",
            "B max",
            "A before B",
            "Jain",
            "A jobs/s",
            "rounds",
            "note",
            "load",
            "others",
        ],
        rows,
    )


#: What a user of each peer would have to do for weights (the weights scenario has no
#: counterpart in them).
PEER_WEIGHTS = {
    "procrastinate": "no weights: a queue per tenant with its own workers, sized 3:1 by hand "
    "(static; idle when that tenant has no work)",
    "pgqueuer": "no weights: an entrypoint per tenant with concurrency_limit 3:1 of the slots "
    "(a static split of the slots; idle when that tenant has no work)",
    "django-tasks-db": "no weights: a queue per tenant and 3:1 db_worker processes per queue "
    "(static)",
    FLOOR: "no weights (first in, first out)",
}


def _timeshare_table(systems: dict[str, dict[str, Any]], scenario: str = "timeshare") -> str:
    rows = []
    unable = []
    for name, s in systems.items():
        for c in s.get(scenario) or []:
            rows.append(
                [
                    name,
                    c["variant"],
                    f"{c['backlog']:,}",
                    c["workers"],
                    c["a_jobs"],
                    c["b_jobs"],
                    f"{c['a_time_share']:.2f} / {c['b_time_share']:.2f}",
                    *_jains(c),
                    f"{c['starved_ms']:,.0f} ({c['starved']})" if "starved_ms" in c else None,
                    c.get("note") or ("no job started in the window" if _idle(c) else ""),
                    c.get("load1"),
                    _others(c),
                ]
            )
        if scenario == "weights" and not s.get(scenario) and "weights" in s.get("scenarios", []):
            rows.append([name, "n/a", *([None] * 8), "no weights (below)", None, None])
            unable.append(f"\n  * {name}: {PEER_WEIGHTS.get(name, 'no weights')}")
    if scenario == "weights":
        title = "(d) Weights: B weighs 3, A 1, by time; A's jobs take 100 ms, B's 20 ms"
    else:
        title = "(c) Heavy against light: A's jobs take 200 ms, B's 5 ms, both backlogged"
    table = _table(
        title,
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
            "starved ms",
            "note",
            "load",
            "others",
        ],
        rows,
    )
    return table + (
        "\n  * time A / B: shares of worker time (jobs started in the last 80 % of the window x "
        "their duration); Jain's index over each tenant's worker time (count) over its weight; "
        "starved: the longest a tenant went without a job starting in that part of the window."
        + "".join(unable)
    )


def _idle(cell: dict[str, Any]) -> bool:
    """No job of either tenant started in the measured window: there are no shares."""
    return not (cell["a_jobs"] or cell["b_jobs"])


def _jains(cell: dict[str, Any]) -> list[Any]:
    return [None, None] if _idle(cell) else [cell["jain_time"], cell["jain_count"]]


def _bursts_table(systems: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, s in systems.items():
        for c in s.get("bursts") or []:
            rows.append(
                [
                    name,
                    c["variant"],
                    f"{c['backlog']:,}",
                    c["workers"],
                    f"{c['tenants'] - c['unserved']}/{c['tenants']}",
                    c["slowdown_mean"],
                    c["slowdown_p50"],
                    f"{c['slowdown_max']} ({c['worst']})",
                    c["jain_slowdown"],
                    _wait(c, "wait_p50_ms"),
                    _wait(c, "wait_p99_ms"),
                    f"{c['starved_ms']:,.0f} ({c['starved']})",
                    c["a_time_share"],
                    c.get("note") or "",
                    c.get("load1"),
                    _others(c),
                ]
            )
    table = _table(
        "(e) Bursts: tenants arriving at random beside A's backlog (completion time over the "
        "ideal fair schedule's)",
        [
            "system",
            "variant",
            "A backlog",
            "P x C",
            "served",
            "mean",
            "p50",
            "worst",
            "Jain",
            "wait p50",
            "wait p99",
            "starved ms",
            "A time",
            "note",
            "load",
            "others",
        ],
        rows,
    )
    return table + (
        "\n  * slowdown: a tenant's completion time (its last job's start + duration - its "
        "commit) over the same under the ideal fair schedule (the P x C workers split equally "
        "among the tenants with work, A always among them, none given more workers than it has "
        "jobs); a tenant not served in time counts until the cell gave up (a lower bound). "
        "Jain: over ideal / actual (1: all slowed down alike). A time: A's share of worker "
        "time while the bursts ran."
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
    for scenario, how in (("fairness", ""), ("sybil", " spread over keys")):
        for c in us.get(scenario) or []:
            p99 = c["b_p99_ms"]
            found.append(
                {
                    "goal": f"B's p99 < 50 ms with A's backlog {c['a_backlog']:,}{how}",
                    "measured": f"{p99} ms (p50 {c['b_p50_ms']} ms, Jain {c['jain_min']}, "
                    f"load {c.get('load1')})",
                    "met": p99 is not None and p99 < 50 and not c["timed_out"],
                }
            )
    for scenario, what in (("timeshare", "heavy against light"), ("weights", "weights 3:1")):
        for c in us.get(scenario) or []:
            if c["variant"] != "by-time":
                continue
            found.append(
                {
                    "goal": f"Jain over worker time >= 0.95, {what}, backlog {c['backlog']:,}",
                    "measured": f"{c['jain_time']} (time A / B {c['a_time_share']:.2f} / "
                    f"{c['b_time_share']:.2f}, load {c.get('load1')})",
                    "met": not _idle(c) and c["jain_time"] >= 0.95,
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


#: what --plots draws, said when a run has none of it
PLOTTED = "plots are drawn of the e2e, fairness, sybil, timeshare and weights scenarios only"


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
        (f"{name} ({c['variant']}){' sybil' if scenario == 'sybil' else ''}", c)
        for name, s in systems.items()
        for scenario in ("fairness", "sybil")
        for c in s.get(scenario) or []
        if c["b_p99_ms"] is not None
    ]
    labels = sorted({label for label, _ in rows})
    series = [
        Series(
            label,
            sorted((c["a_backlog"], c["b_p99_ms"]) for lab, c in rows if lab == label),
            "s--" if label.endswith(" sybil") else "o-",
        )
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
    written += _share_plots(systems, directory)
    return written


def _share_plots(systems: dict[str, dict[str, Any]], directory: Path) -> list[Path]:
    """Jain's index over worker time in (c) and (d), and the bursts' slowdowns, against the
    backlog, every system and variant."""
    written: list[Path] = []
    series = []
    for scenario, tag in (("timeshare", "(c)"), ("weights", "(d)")):
        for name, s in systems.items():
            cells = s.get(scenario) or []
            for variant in sorted({c["variant"] for c in cells}):
                points = sorted(
                    (c["backlog"], c["jain_time"])
                    for c in cells
                    if c["variant"] == variant and not _idle(c)
                )
                series.append(
                    Series(f"{tag} {name} ({variant})", points, "s--" if tag == "(d)" else "o-")
                )
    if series:
        written.append(
            line_chart(
                Chart(
                    title="Jain's index over worker time: heavy vs light (c), weights 3:1 (d)",
                    xlabel="each tenant's backlog (jobs, log)",
                    ylabel="Jain's index over worker time",
                    series=series,
                    logx=True,
                    hline=(0.95, "goal: 0.95"),
                ),
                directory / "compare-timeshare.png",
            )
        )
    series = []
    for name, s in systems.items():
        cells = s.get("bursts") or []
        for variant in sorted({c["variant"] for c in cells}):
            mine = [c for c in cells if c["variant"] == variant]
            series.append(
                Series(
                    f"{name} ({variant}) worst",
                    sorted((c["backlog"], c["slowdown_max"]) for c in mine),
                )
            )
            series.append(
                Series(
                    f"{name} ({variant}) mean",
                    sorted((c["backlog"], c["slowdown_mean"]) for c in mine),
                    "s--",
                )
            )
    if series:
        written.append(
            line_chart(
                Chart(
                    title="(e) Bursts: completion time over the ideal fair schedule's",
                    xlabel="A's backlog (jobs, log)",
                    ylabel="slowdown (log; 1 = ideal)",
                    series=series,
                    logx=True,
                    logy=True,
                    hline=(1.0, "ideal"),
                ),
                directory / "compare-bursts.png",
            )
        )
    return written
