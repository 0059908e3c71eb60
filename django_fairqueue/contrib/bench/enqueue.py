"""Enqueue rate through the public API: one message per transaction, and batches of 100; plain,
and as unique jobs (a new key per message, and a key already held)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from typing import Any

from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.contrib.bench.figures import median, spread_pct
from django_fairqueue.contrib.bench.harness import START_TIMEOUT, Bench, load1
from django_fairqueue.contrib.bench.scenario import SPREAD_NOTE, Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME

BATCH = 100
#: mode -> (messages per call, channels one call writes to)
MODES = {
    "single": "enqueue(), one message per transaction",
    "batch": f"enqueue_many() of {BATCH}, one channel per call",
    "batch-mixed": f"enqueue_many() of {BATCH}, spread over {BATCH} channels",
    "single-key": "enqueue() with a new unique_key each call (every message stored)",
    "batch-key": f"enqueue_many() of {BATCH}, one channel, a new unique_key per message",
    "single-held": "enqueue() of a unique_key its channel's message holds (keep: nothing stored)",
}


@dataclass(frozen=True)
class EnqueueCell:
    mode: str
    processes: int

    @property
    def label(self) -> str:
        return f"enqueue {self.mode:<11} x{self.processes}"


def _is_single(mode: str) -> bool:
    return mode.startswith("single")


@dataclass(frozen=True)
class EnqueueResult:
    mode: str
    batch: int
    processes: int
    messages: int
    calls: int
    seconds: float
    #: messages/s, the median of the runs
    rate: float
    rates: list[float]
    call_ms: float
    load1: float

    @property
    def spread_pct(self) -> float | None:
        return spread_pct(self.rates, self.rate)


def plan(sizes: Sizes) -> list[EnqueueCell]:
    return [EnqueueCell(mode, n) for mode in MODES for n in sizes.enqueue_processes]


def _worker(index: int, mode: str, duration: float, channels: int, start: Barrier) -> Any:
    names = [f"tenant-{i:04d}" for i in range(channels)]
    k = index  # processes start on different channels

    def call() -> int:
        nonlocal k
        k += 1
        if mode == "single":
            enqueue(NOOP_TASK_NAME, k, channel=names[k % channels])
            return 1
        if mode == "single-key":
            enqueue(NOOP_TASK_NAME, k, channel=names[k % channels], unique_key=f"{index}-{k}")
            return 1
        if mode == "single-held":
            enqueue(NOOP_TASK_NAME, k, channel=names[k % channels], unique_key="held")
            return 1
        if mode in ("batch", "batch-key"):
            channel = names[k % channels]
            keyed = mode == "batch-key"
            enqueue_many(
                EnqueueRequest(
                    NOOP_TASK_NAME,
                    (k, j),
                    channel=channel,
                    unique_key=f"{index}-{k}-{j}" if keyed else None,
                )
                for j in range(BATCH)
            )
        else:
            enqueue_many(
                EnqueueRequest(NOOP_TASK_NAME, (k, j), channel=names[(k + j) % channels])
                for j in range(BATCH)
            )
        return BATCH

    for _ in range(3):  # connect, prepare the statement
        call()
    start.wait(START_TIMEOUT)
    began = time.perf_counter()
    deadline = began + duration
    messages = calls = 0
    while time.perf_counter() < deadline:
        messages += call()
        calls += 1
    return messages, calls, began, time.perf_counter()


def run(bench: Bench, cell: EnqueueCell) -> EnqueueResult:
    sizes = bench.sizes
    rates: list[float] = []
    runs = []
    load = load1()
    for trial in range(sizes.repeat):
        bench.reset()
        with bench.processes() as group:
            start = group.barrier(cell.processes + 1)
            group.start(
                cell.processes, _worker, cell.mode, sizes.duration, sizes.enqueue_channels, start
            )
            start.wait(START_TIMEOUT)
            began = time.monotonic()

            def tick(trial: int = trial, began: float = began) -> None:
                elapsed = time.monotonic() - began
                bench.progress.update(
                    f"run {trial + 1}/{sizes.repeat}  {elapsed:.1f}/{sizes.duration:.1f}s",
                    elapsed / sizes.duration,
                )

            out = group.collect(timeout=sizes.duration + START_TIMEOUT, tick=tick)
        messages = sum(o[0] for o in out)
        calls = sum(o[1] for o in out)
        seconds = max(o[3] for o in out) - min(o[2] for o in out)
        rates.append(messages / seconds)
        runs.append((messages, calls, seconds))
    pick = sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]
    messages, calls, seconds = runs[pick]
    bench.reset()
    return EnqueueResult(
        mode=cell.mode,
        batch=1 if _is_single(cell.mode) else BATCH,
        processes=cell.processes,
        messages=messages,
        calls=calls,
        seconds=round(seconds, 3),
        rate=round(median(rates), 1),
        rates=[round(r, 1) for r in rates],
        call_ms=round(1000 * seconds * cell.processes / calls, 3),
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="enqueue",
    title="Enqueue rate (messages/s)",
    plan=plan,
    run=run,
    columns=(
        Column("mode", "mode"),
        Column("batch", "batch"),
        Column("processes", "processes"),
        Column("messages/s", "rate", ",.0f"),
        Column("spread %", "spread_pct", ".0f"),
        Column("ms/call", "call_ms", ".2f"),
        Column("messages", "messages", ","),
        Column("seconds", "seconds", ".1f"),
    ),
    summary=lambda r: f"{r.rate:,.0f} messages/s",
    key=("mode", "processes"),
    metric="rate",
    notes=(
        *(f"{mode}: {what}" for mode, what in MODES.items()),
        "Each call is its own transaction (autocommit), through the public API: payload "
        "validation and JSON encoding in Python included. Processes use channels in turn over "
        "the configured number of channels, created on first use.",
        SPREAD_NOTE,
    ),
)
