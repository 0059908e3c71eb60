"""Claim + complete throughput: N claimer processes in a tight claim -> complete loop.

Each cycle is claim_messages, then complete_messages: two round trips and two commits, as the
worker's claimer and settler make them, commit mode included (``ASYNC_COMMIT``). (``mode`` is
always ``separate``; earlier records also have a ``combined`` mode, of a complete-and-claim call
the worker never used, since removed.)

Each cell starts from empty tables, pre-filled with enough ready messages that it should not
run dry. The pre-fill is sized from a short single-claimer probe per (channels, batch) pair;
if a cell still drains the queue it stops there and reports the rate over the time it ran.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.synchronize import Barrier, Event
from typing import Any

from django_fairqueue.contrib.bench.figures import median, spread_pct
from django_fairqueue.contrib.bench.harness import START_TIMEOUT, Bench, claim_and_complete, load1
from django_fairqueue.contrib.bench.scenario import SPREAD_NOTE, Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes

LEASE = timedelta(minutes=10)
#: Claims each process makes before the start line (connection, prepared statements, the
#: claim function's cached plans), not measured.
WARMUP_CLAIMS = 5
#: The pre-fill covers the expected rate times this.
FILL_MARGIN = 1.5


@dataclass(frozen=True)
class ClaimCell:
    channels: int
    batch: int
    claimers: int
    mode: str = "separate"  # the only mode now (older records also have "combined")

    @property
    def label(self) -> str:
        return (
            f"claim+complete {self.channels:>3} ch  batch {self.batch:>3}  x{self.claimers}"
            f"  {self.mode}"
        )


@dataclass(frozen=True)
class ClaimResult:
    channels: int
    batch: int
    claimers: int
    mode: str
    #: messages claimed and completed per second, the median of the runs
    rate: float
    rates: list[float]
    messages: int
    claims: int
    #: claims that came back empty while ready messages remained, in % of all claims
    empty_pct: float
    #: average messages per non-empty claim
    per_claim: float
    seconds: float
    fill: int
    #: the queue drained before the cell's time was up (the rate is over the time it ran)
    ran_dry: bool
    load1: float

    @property
    def spread_pct(self) -> float | None:
        return spread_pct(self.rates, self.rate)


def plan(sizes: Sizes) -> list[ClaimCell]:
    return [
        ClaimCell(channels, batch, claimers, mode)
        for channels in sizes.claim_channels
        for batch in sizes.claim_batches
        for mode in ("separate",)
        for claimers in sizes.claimers
    ]


def channel_names(count: int) -> list[str]:
    return [f"tenant-{i:05d}" for i in range(count)]


def _worker(
    index: int,
    using: str,
    batch: int,
    mode: str,
    duration: float,
    fill: int,
    claimed: Any,  # ctypes array of per-process claimed counts, shared without a lock
    dry: Event,
    start: Barrier,
) -> Any:
    worker_id = f"fairbench-{os.getpid()}"
    slack = batch * len(claimed)  # rows other claimers may hold right now

    def cycle() -> int:
        got = claim_and_complete(batch, LEASE, worker_id, using)
        claimed[index] += len(got)
        return len(got)

    for _ in range(WARMUP_CLAIMS):
        cycle()
    start.wait(START_TIMEOUT)
    began = time.perf_counter()
    deadline = began + duration
    messages = claims = empty = 0
    while not dry.is_set() and time.perf_counter() < deadline:
        got = cycle()
        claims += 1
        messages += got
        if got == 0:
            # Lock-free read of the shared counters: a few messages' staleness is harmless.
            if sum(claimed[:]) >= fill - slack:
                dry.set()  # the queue is (nearly) drained: not an empty claim, the end
                claims -= 1
                break
            empty += 1
    ended = time.perf_counter()
    return messages, claims, empty, began, ended


def _measure(bench: Bench, cell: ClaimCell, fill: int, duration: float) -> dict[str, Any]:
    bench.reset()
    bench.load(channel_names(cell.channels), fill)
    with bench.processes() as group:
        claimed = group.ctx.Array("q", cell.claimers, lock=False)
        dry = group.event()
        start = group.barrier(cell.claimers + 1)
        group.start(
            cell.claimers,
            _worker,
            bench.using,
            cell.batch,
            cell.mode,
            duration,
            fill,
            claimed,
            dry,
            start,
        )
        start.wait(START_TIMEOUT)
        began = time.monotonic()

        def tick() -> None:
            elapsed = time.monotonic() - began
            bench.progress.update(
                f"{sum(claimed[:]):,}/{fill:,} claimed  {elapsed:.1f}/{duration:.1f}s",
                elapsed / duration,
            )

        out = group.collect(timeout=duration + START_TIMEOUT, tick=tick)
    messages = sum(o[0] for o in out)
    claims = sum(o[1] for o in out)
    seconds = max(o[4] for o in out) - min(o[3] for o in out)
    return {
        "messages": messages,
        "claims": claims,
        "empty": sum(o[2] for o in out),
        "seconds": seconds,
        "rate": messages / seconds if seconds > 0 else 0.0,
        "ran_dry": dry.is_set(),
    }


def _probe_rate(bench: Bench, channels: int, batch: int, mode: str) -> float:
    """Messages/s of one claimer, measured briefly; sizes the pre-fill of the real cells."""
    key = (channels, batch, mode)
    rates: dict[tuple[int, int, str], float] = bench.state.setdefault("claim.probe", {})
    if key not in rates:
        sizes = bench.sizes
        # A generous guess for the probe's own fill; running dry only shortens the probe.
        guess = min(2_000 * batch, 80_000)
        fill = min(sizes.max_fill, max(1_000, int(guess * sizes.calibration * 2)))
        fill += WARMUP_CLAIMS * batch
        bench.progress.update("probing the rate to size the pre-fill")
        probe = _measure(bench, ClaimCell(channels, batch, 1, mode), fill, sizes.calibration)
        rates[key] = max(probe["rate"], 1.0)
    return rates[key]


def run(bench: Bench, cell: ClaimCell) -> ClaimResult:
    sizes = bench.sizes
    load = load1()
    rate1 = _probe_rate(bench, cell.channels, cell.batch, cell.mode)
    # Claimers scale at most with the cores (the server shares them); the margin and the
    # early stop cover the rest.
    expected = rate1 * min(cell.claimers, bench.cpus)
    fill = math.ceil(expected * sizes.duration * FILL_MARGIN)
    fill += (WARMUP_CLAIMS + 2) * cell.batch * cell.claimers
    fill = min(fill, sizes.max_fill)
    runs = [_measure(bench, cell, fill, sizes.duration) for _ in range(sizes.repeat)]
    rates = [r["rate"] for r in runs]
    pick = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
    bench.reset()
    full = pick["claims"] - pick["empty"]
    return ClaimResult(
        channels=cell.channels,
        batch=cell.batch,
        claimers=cell.claimers,
        mode=cell.mode,
        rate=round(median(rates), 1),
        rates=[round(r, 1) for r in rates],
        messages=pick["messages"],
        claims=pick["claims"],
        empty_pct=round(100 * pick["empty"] / pick["claims"], 2) if pick["claims"] else 0.0,
        per_claim=round(pick["messages"] / full, 2) if full else 0.0,
        seconds=round(pick["seconds"], 3),
        fill=fill,
        ran_dry=any(r["ran_dry"] for r in runs),
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="claim",
    title="Claim + complete throughput (messages/s)",
    plan=plan,
    run=run,
    columns=(
        Column("channels", "channels"),
        Column("batch", "batch"),
        Column("claimers", "claimers"),
        Column("mode", "mode"),
        Column("messages/s", "rate", ",.0f"),
        Column("spread %", "spread_pct", ".0f"),
        Column("empty %", "empty_pct", ".1f"),
        Column("msgs/claim", "per_claim", ".1f"),
        Column("claims", "claims", ","),
        Column("seconds", "seconds", ".1f"),
        Column("pre-fill", "fill", ","),
        Column("ran dry", "ran_dry"),
    ),
    summary=lambda r: f"{r.rate:,.0f} messages/s, {r.empty_pct:.1f}% empty",
    key=("channels", "batch", "claimers", "mode"),
    metric="rate",
    notes=(
        "Each claimer is a process looping claim_messages(batch) -> complete_messages(), as "
        "a worker's claimer and settler do; messages are spread round-robin over the "
        "channels and pre-filled, then ANALYZE.",
        "empty %: claims that returned nothing while ready messages remained (locked by a "
        "concurrent claim, or the channels' turns were taken).",
        "ran dry: the queue drained early; the rate is over the time the cell ran.",
        SPREAD_NOTE,
    ),
)
