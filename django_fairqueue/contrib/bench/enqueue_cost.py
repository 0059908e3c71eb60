"""What one enqueue costs: server time inside the enqueue functions, and client CPU, per call.

The enqueue scenario's rates include the commit's WAL flush and whatever else the machine runs,
which on a shared machine move a cell by a factor of two. This one calls the public API from
one process and reads what a change to the SQL or to ``api.py`` changes: the time PostgreSQL
spends inside the enqueue function the call runs (``pg_stat_user_functions``, with
``track_functions = 'pl'`` for its own session; nested functions included), and the CPU the
calling process used (``time.process_time``: validation, encoding, the driver). Each call is its
own transaction, as in the enqueue scenario; the commit is in neither figure. Where the server
runs on this host, the server backend's CPU per call is read from ``/proc`` as well (the whole
statement and its commit, without waits for a core or the disk).

Cells: ``single`` (``enqueue()``), ``batch`` (``enqueue_many()`` of 100, one channel), and,
where the code has unique jobs, ``single-key`` / ``batch-key`` (a new key per message: every
message stored) and ``single-held`` (a key its channel's message holds: kept, nothing stored);
``single-key-active`` / ``batch-key-active`` are the keyed cells with scope ``active`` (the
key's hold row written too), and ``single-key-held-running`` a key held by a running message of
that scope.
Needs PostgreSQL 15+ and a role allowed to set ``track_functions``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_fairqueue import api
from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.functions import unavailable
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, backend_cpu, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import message_store

BATCH = 100
CHANNELS = 10
ONE = "fairqueue_enqueue_one_v1"
MANY = "fairqueue_enqueue_v1"
#: mode -> what a call does
MODES = {
    "single": "enqueue() of one message",
    "batch": f"enqueue_many() of {BATCH}, one channel",
    "single-key": "enqueue() with a new unique_key",
    "batch-key": f"enqueue_many() of {BATCH}, one channel, a new unique_key per message",
    "single-held": "enqueue() of a unique_key held by its channel's message (kept)",
    "single-key-active": "enqueue() with a new unique_key of scope active",
    "batch-key-active": f"enqueue_many() of {BATCH}, one channel, a new unique_key of scope active "
    "per message",
    "single-key-held-running": "enqueue() of a unique_key held by its channel's running message "
    "of scope active (kept)",
}


def _has_unique_jobs() -> bool:
    return hasattr(api, "UNIQUE_SCOPES")


@dataclass(frozen=True)
class EnqueueCostCell:
    mode: str

    @property
    def label(self) -> str:
        return f"enqueue cost  {self.mode}"


@dataclass(frozen=True)
class EnqueueCostResult:
    mode: str
    batch: int
    calls: int
    #: microseconds per call inside the enqueue function (nested functions included)
    server_us: float
    #: microseconds of the calling process's CPU per call
    client_us: float
    #: microseconds of the server backend's CPU per call (None: unreadable)
    backend_cpu_us: float | None
    #: both per message
    server_us_per_message: float
    client_us_per_message: float
    load1: float


def plan(sizes: Sizes) -> list[EnqueueCostCell]:
    modes = MODES if _has_unique_jobs() else {m: w for m, w in MODES.items() if "-" not in m}
    return [EnqueueCostCell(mode) for mode in modes]


def run(bench: Bench, cell: EnqueueCostCell) -> EnqueueCostResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    names = [f"tenant-{i:02d}" for i in range(CHANNELS)]
    single = cell.mode.startswith("single")
    calls = max(10, sizes.functions_samples // (2 if single else 40))
    k = 0

    def call() -> None:
        nonlocal k
        k += 1
        channel = names[k % CHANNELS]
        if cell.mode == "single":
            enqueue(NOOP_TASK_NAME, k, channel=channel)
        elif cell.mode == "single-key":
            enqueue(NOOP_TASK_NAME, k, channel=channel, unique_key=f"k{k}")
        elif cell.mode == "single-held":
            enqueue(NOOP_TASK_NAME, k, channel=channel, unique_key="held")
        elif cell.mode == "single-key-active":
            enqueue(NOOP_TASK_NAME, k, channel=channel, unique_key=f"k{k}", unique_scope="active")
        elif cell.mode == "single-key-held-running":
            enqueue(NOOP_TASK_NAME, k, channel=channel, unique_key="run", unique_scope="active")
        else:
            keyed = cell.mode in ("batch-key", "batch-key-active")
            options: dict[str, Any] = {}
            if cell.mode == "batch-key-active":
                options["unique_scope"] = "active"
            # (no unique_key argument at all when unkeyed: the scenario also measures code from
            # before unique jobs, whose EnqueueRequest has no such field)
            enqueue_many(
                EnqueueRequest(
                    NOOP_TASK_NAME,
                    (k, j),
                    channel=channel,
                    **({**options, "unique_key": f"k{k}-{j}"} if keyed else options),
                )
                for j in range(BATCH)
            )

    for _ in range(2 * CHANNELS):  # channels created, statements prepared, plans cached
        call()
    if cell.mode == "single-key-held-running":
        # the holders start: each channel's message of key "run" is claimed, and stays running
        message_store.claim_messages(
            10 * CHANNELS,
            lease=timedelta(hours=1),
            worker_id="fairbench-enqueue-cost",
            using=using,
        )
    reason = unavailable(using)
    if reason is not None:
        raise BenchmarkError(f"enqueue_cost: {reason}")
    backend = backend_cpu(using)
    before = db.select_function_times(using=using)
    server_cpu = backend() if backend is not None else 0.0
    cpu = time.process_time()
    for i in range(calls):
        call()
        if i % 100 == 0:
            bench.progress.update(f"{i:,}/{calls:,} calls", i / calls)
    cpu = time.process_time() - cpu
    server_cpu = (backend() if backend is not None else 0.0) - server_cpu
    db.force_stats_flush(using=using)
    after = db.select_function_times(using=using)
    bench.reset()
    name = ONE if single else MANY
    old = before.get(name, (0, 0.0, 0.0))
    new = after.get(name, (0, 0.0, 0.0))
    counted = new[0] - old[0]
    if counted < calls:
        raise BenchmarkError(
            f"enqueue_cost: pg_stat_user_functions counted {counted} calls of {name}, "
            f"expected {calls} (statistics not flushed?)"
        )
    server_us = 1000 * (new[1] - old[1]) / counted
    client_us = 1e6 * cpu / calls
    batch = 1 if single else BATCH
    return EnqueueCostResult(
        mode=cell.mode,
        batch=batch,
        calls=calls,
        server_us=round(server_us, 1),
        client_us=round(client_us, 1),
        backend_cpu_us=round(1e6 * server_cpu / calls, 1) if backend is not None else None,
        server_us_per_message=round(server_us / batch, 2),
        client_us_per_message=round(client_us / batch, 2),
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="enqueue_cost",
    title="What one enqueue costs (microseconds per call)",
    plan=plan,
    run=run,
    columns=(
        Column("mode", "mode"),
        Column("batch", "batch"),
        Column("server µs", "server_us", ".1f"),
        Column("client µs", "client_us", ".1f"),
        Column("backend CPU µs", "backend_cpu_us", ".0f"),
        Column("server µs/msg", "server_us_per_message", ".2f"),
        Column("client µs/msg", "client_us_per_message", ".2f"),
        Column("calls", "calls", ","),
    ),
    summary=lambda r: f"server {r.server_us:.1f} µs, client {r.client_us:.1f} µs",
    key=("mode",),
    metric="server_us",
    higher_is_better=False,
    unavailable=unavailable,
    notes=(
        *(f"{mode}: {what}" for mode, what in MODES.items()),
        "server µs: time inside the enqueue function the call runs (pg_stat_user_functions, "
        "nested calls included; not the statement around it, not the commit). client µs: CPU "
        "of the calling process (validation, JSON, the driver). One process, each call its "
        "own transaction, over 10 channels.",
    ),
)
