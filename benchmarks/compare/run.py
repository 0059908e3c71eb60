"""django-fairqueue beside procrastinate, pgqueuer, django-tasks-db and the raw SQL floor.

One command, one PostgreSQL server, one run (docs/performance.md, "Side by side")::

    python3 dev.py tox -e compare -- --plots docs/img

Each system gets a fresh database of its own on the same server (``compare_<system>``, created
and dropped here; only databases carrying this benchmark's comment are ever dropped), its schema
installed by its own tools, and runs in a process of its own (the Django-based ones need their
own settings). The same scenarios for all:

- enqueue: one job per transaction, and batches of 100 of one tenant (the system's batch API
  where it has one), 1 and 2 processes, for ``duration`` seconds each;
- end to end: a bulk-loaded backlog of no-op jobs drained by real worker processes, a sweep of
  processes x concurrency per system; the rate while 10% to 90% of it started;
- pickup: one idle worker, one job at a time: handler start minus enqueue commit;
The fairness scenarios (``--fair`` runs these five alone), each at a backlog of 10,000 and
of 1,000,000 (``--sizes full``; ``quick``: 10,000 only). Tenant A is the big one ("bob"), B
the small one ("alice"). Every backlog is loaded in bulk, untimed, with one ``INSERT ...
SELECT`` per 100,000 rows of the system's own rows (the rows its enqueue writes, its triggers
firing), so a million-job cell loads in seconds:

- fairness (a): A's backlog is loaded and the workers (the system's best end-to-end
  configuration, or its ``fair_config`` when e2e was left out: its best on the development
  machine) start on it; B then enqueues 10 jobs in
  one transaction, up to 5 rounds while A still has work. B's wait: handler start minus B's
  commit; A's jobs/s meanwhile; Jain's index over the jobs A and B started while B waited. A
  round B waits for longer than ``fairness_timeout`` (``big_timeout`` from 100,000 jobs on) is
  given up and reported as such: a first-in-first-out queue makes B wait for all of A.
- sybil (b): the same with A's backlog spread round-robin over 100 keys, B's bursts in one key
  of hers. django-fairqueue: A's channels ``A/c00`` ... ``A/c99`` of channel group ``A``, B's
  ``B/c00`` of group ``B`` (``channel=("A", "c17")``). A peer uses what it has per key, in the
  same variants as in (a): procrastinate a lock per key, pgqueuer an entrypoint per key with a
  concurrency limit; django-tasks-db and the floor have nothing (first in, first out).
- timeshare (c): heavy against light, both backlogged: A's jobs take 200 ms, B's 5 ms (the
  handler sleeps after its stamp), loaded in alternating chunks of 100 (first in, first out
  alternates too); the same 2 x 4 workers for every system; each tenant's share of worker time
  over the last 12 s of a 15 s window, Jain's index over worker time and over counts, the
  longest a tenant went without a job starting. django-fairqueue runs fair by count and by
  time.
- weights (d): B weighs 3, A 1, by time (django-fairqueue's channel ``weight``, fairness by
  time); A's jobs take 100 ms, B's 20 ms; otherwise as (c): the time shares should be 1:3.
  No peer has weights: each is reported as n/a with what its users would have to do.
- bursts (e): A's backlog of 20 ms jobs keeps the 2 x 4 workers busy; 50 tenants arrive at
  random moments in the first 9 s (a fixed seed: the same plan for every system), each with 1
  to 40 jobs of 5-50 ms queued in one transaction. Each tenant's completion time (its last job's
  start plus its duration, minus its commit) over its completion time under the ideal fair
  schedule
  (:func:`django_fairqueue.contrib.bench.figures.fair_completion_times`: processor sharing, the 8
  workers split equally among the tenants with work, A always among them, none given more
  workers than it has jobs, what one cannot use going to the others); the mean and the worst,
  Jain's index over ideal / actual, the tenants' waits and the longest starvation.

Each peer runs in its best honest configuration for fairness: its documented mechanism where it
has one (procrastinate's ``lock`` per tenant or key, pgqueuer's entrypoint per tenant or key
with ``concurrency_limit`` = half the fleet's slots) beside its plain first-in-first-out
configuration, the same workers as its throughput cells.

The server is ``DATABASE_URL``'s, or the embedded development server (django_fairqueue.devdb).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.compare.common import (
    STAMP_ALL_ENV,
    WORK_ENV,
    Backlog,
    BenchError,
    Fleet,
    WorkerConfig,
    dsn_fields,
    dsn_url,
    dsn_with,
)

# No Django import in either: safe before settings. `--baseline REF` runs this harness on the
# package of an earlier REF, which had them at the top level.
try:
    from django_fairqueue.cli import terminal
    from django_fairqueue.contrib.bench.figures import jain_index, percentile
except ImportError:
    from django_fairqueue import terminal  # type: ignore[attr-defined,no-redef]
    from django_fairqueue.figures import jain_index, percentile  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
#: The baseline's git ref, for its version label (set for its process).
BASELINE_REF_ENV = "COMPARE_BASELINE_REF"
SYSTEMS = ("raw-sql", "django-fairqueue", "procrastinate", "pgqueuer", "django-tasks-db")
#: ``--baseline REF``: django-fairqueue as it was at REF, run beside this checkout's in the
#: same rounds (a before/after measured under the same load).
BASELINE = "django-fairqueue-baseline"
#: What ``--scenario`` may name, in the order they run.
SCENARIOS = ("enqueue", "e2e", "pickup", "fairness", "sybil", "timeshare", "weights", "bursts")
#: The scenarios run in rounds (every system once per round, the order rotated; ratios taken
#: within a round): the enqueue cells always, whose rate drifts within minutes on a shared
#: machine; with ``--baseline`` the end-to-end and pickup cells too, so before and after
#: alternate. ``--baseline`` measures these alone (an earlier commit may lack what the
#: fairness scenarios configure: groups, weights, fairness by time).
ROUND_SCENARIOS = ("enqueue",)
BASELINE_SCENARIOS = ("enqueue", "e2e", "pickup")
#: The fairness scenarios (``--fairness`` runs these alone).
FAIRNESS_SCENARIOS = ("fairness", "sybil", "timeshare", "weights", "bursts")
DJANGO_SYSTEMS = {
    "django-fairqueue": "fairqueue",
    BASELINE: "fairqueue",
    "django-tasks-db": "django-tasks-db",
}
MARK = "django-fairqueue benchmarks/compare database (dropped by every run)"
#: Each system's database is named this plus the system's name (``--db-prefix``).
DB_PREFIX = "compare_"
SERVER_SETTINGS = (
    "server_version",
    "shared_buffers",
    "work_mem",
    "synchronous_commit",
    "fsync",
    "wal_sync_method",
    "wal_level",
    "full_page_writes",
    "max_wal_size",
    "checkpoint_timeout",
    "jit",
    "max_connections",
    "autovacuum",
    "io_method",
)


@dataclass(frozen=True)
class Sizes:
    name: str
    duration: float = 3.0
    enqueue_processes: tuple[int, ...] = (1, 2)
    #: an end-to-end backlog drains in about this many seconds at the previous cell's rate
    e2e_seconds: float = 6.0
    e2e_min: int = 3_000
    e2e_max: int = 200_000
    e2e_first_guess: float = 1_000.0
    #: how many of each system's configurations (all if 0)
    e2e_configs: int = 0
    pickup_samples: int = 60
    pickup_poll_samples: int = 25
    fairness_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    #: backlogs for systems other than django-fairqueue (each is loaded in bulk in seconds; a
    #: first-in-first-out queue then makes B wait for all of A, which at a million is given up
    #: after ``big_timeout``: the cell says so)
    peer_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    #: the sybil scenario: A's backlog spread over 100 keys (every system)
    sybil_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    sybil_keys: int = 100
    fairness_burst: int = 10
    fairness_rounds: int = 5
    fairness_pause: float = 0.2
    #: seconds B's burst may wait before the round is given up (reported as such)
    fairness_timeout: float = 120.0
    #: the same from a backlog of 100,000 on (a queue that makes B wait for all of a million
    #: would take minutes per cell to say what a timeout says)
    big_timeout: float = 60.0
    #: timeshare and weights: each tenant's backlog, loaded in alternating chunks (so first
    #: in, first out serves them alternately too), and the seconds measured after both started
    timeshare_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    timeshare_chunk: int = 100
    timeshare_window: float = 15.0
    #: bursts: A's background backlog, the tenants arriving within 0.6 x the window, the
    #: most jobs one brings
    bursts_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    bursts_tenants: int = 50
    bursts_max: int = 40
    bursts_window: float = 15.0
    #: the workers of the fairness and sybil cells when the end-to-end sweep is left out
    #: (None: the system's ``fair_config``)
    fair_workers: WorkerConfig | None = None


PRESETS = {
    "full": Sizes("full"),
    "quick": Sizes(
        "quick",
        duration=1.5,
        e2e_seconds=3.0,
        e2e_configs=2,
        pickup_samples=20,
        pickup_poll_samples=8,
        fairness_backlogs=(10_000,),
        peer_backlogs=(10_000,),
        sybil_backlogs=(10_000,),
        fairness_rounds=3,
        timeshare_backlogs=(10_000,),
        bursts_backlogs=(10_000,),
    ),
    "tiny": Sizes(
        "tiny",
        duration=0.5,
        enqueue_processes=(1,),
        e2e_seconds=1.0,
        e2e_min=300,
        e2e_max=2_000,
        e2e_configs=1,
        pickup_samples=3,
        pickup_poll_samples=2,
        fairness_backlogs=(3_000,),
        peer_backlogs=(3_000,),
        sybil_backlogs=(3_000,),
        sybil_keys=10,
        fairness_rounds=2,
        fairness_timeout=60.0,
        timeshare_backlogs=(200,),
        timeshare_chunk=50,
        timeshare_window=1.0,
        bursts_backlogs=(200,),
        bursts_tenants=4,
        bursts_max=3,
        bursts_window=1.0,
        fair_workers=WorkerConfig(1, 4),
    ),
}


# ============================================================================================
# One system (in its own process)


def setup_django(dsn: str, app: str = "fairqueue") -> None:
    """Django with the comparison's settings: the Django-based systems run on it, and
    django_fairqueue.contrib.bench (plots, CPU watch) imports the app's models. Connects to nothing
    until a system does."""
    os.environ["COMPARE_DSN"] = dsn
    os.environ["COMPARE_DJANGO_APP"] = app
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.compare.django_settings"
    import django

    django.setup()


def baseline_imports_only_itself() -> None:
    """In the baseline's process: its ``django_fairqueue`` comes first on the path, but an
    editable install of this checkout adds an import finder that serves any submodule the
    baseline lacks from this checkout, which would mix two versions in one process (the
    harness asks for modules by their newer names and falls back to the older ones)."""
    sys.meta_path[:] = [
        finder
        for finder in sys.meta_path
        if not getattr(finder, "__module__", "").startswith("__editable___django_fairqueue")
    ]


def load_system(name: str, dsn: str) -> Any:
    if name == BASELINE:
        baseline_imports_only_itself()
    setup_django(dsn, DJANGO_SYSTEMS.get(name, "fairqueue"))
    if name in ("django-fairqueue", BASELINE):
        from benchmarks.compare.sys_fairqueue import Fairqueue

        system = Fairqueue(dsn)
        if name == BASELINE:
            import django_fairqueue

            if Path(django_fairqueue.__file__).resolve().is_relative_to(ROOT):
                raise BenchError("the baseline imports this checkout's django_fairqueue")
            system.name = BASELINE
            system.version += f" at {os.environ.get(BASELINE_REF_ENV, '?')}"
        return system
    if name == "django-tasks-db":
        from benchmarks.compare.sys_django_tasks_db import DjangoTasksDb

        return DjangoTasksDb(dsn)
    if name == "procrastinate":
        from benchmarks.compare.sys_procrastinate import Procrastinate

        return Procrastinate(dsn)
    if name == "pgqueuer":
        from benchmarks.compare.sys_pgqueuer import Pgqueuer

        return Pgqueuer(dsn)
    from benchmarks.compare.sys_raw import Raw

    return Raw(dsn)


def say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def bar(label: str, fraction: float) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"{terminal.CLEAR_LINE}  {label} {terminal.bar(fraction)}")
        sys.stderr.flush()


def _enqueue_child(system: Any, mode: str, duration: float, start: Any, out: Any) -> None:
    try:
        out.put(("ok", system.enqueue_loop(mode, duration, start)))
    except BaseException as exc:
        out.put(("error", repr(exc)))
        raise


def enqueue_cell(system: Any, mode: str, processes: int, sizes: Sizes) -> dict[str, Any]:
    system.reset()
    system.close()  # nothing open across the fork
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(processes + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_enqueue_child, args=(system, mode, sizes.duration, start, out))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    start.wait(180)
    results = []
    for _ in procs:
        status, value = out.get(timeout=sizes.duration + 180)
        if status != "ok":
            raise BenchError(f"enqueue process failed: {value}")
        results.append(value)
    for p in procs:
        p.join(30)
    jobs = sum(r[0] for r in results)
    seconds = max(r[2] for r in results) - min(r[1] for r in results)
    system.reset()
    return {
        "mode": mode,
        "processes": processes,
        "jobs": jobs,
        "seconds": round(seconds, 3),
        "rate": round(jobs / seconds, 1),
    }


def _steady_rate(times: list[float]) -> float:
    ordered = sorted(times)
    low = ordered[int(0.1 * (len(ordered) - 1))]
    high = ordered[int(0.9 * (len(ordered) - 1))]
    n = int(0.9 * (len(ordered) - 1)) - int(0.1 * (len(ordered) - 1))
    return n / (high - low) if high > low else float("nan")


def e2e_cell(system: Any, config: WorkerConfig, backlog: int, variant: str) -> dict[str, Any]:
    system.reset()
    system.load("A", backlog, variant)
    system.close()
    env = {**system.worker_env(), STAMP_ALL_ENV: "1"}
    label = f"e2e {config.label}"
    with Fleet(system.worker_commands(config, variant), env) as fleet:
        began = time.time()
        deadline = time.monotonic() + 60 + 60 * backlog / 200
        while len(fleet.stamps.a_times) < backlog:
            bar(label, len(fleet.stamps.a_times) / backlog)
            fleet.check()
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{system.name} {config.label}: {len(fleet.stamps.a_times)} of {backlog} "
                    "jobs ran in time"
                )
            time.sleep(0.05)
        times = list(fleet.stamps.a_times)
    system.reset()
    first, last = min(times), max(times)
    return {
        "processes": config.processes,
        "concurrency": config.concurrency,
        "prefetch": config.prefetch,
        "label": config.label,
        "backlog": backlog,
        "rate": round(_steady_rate(times), 1),
        "drain_rate": round(backlog / max(last - first, 1e-3), 1),
        "startup_s": round(first - began, 2),
        "drain_s": round(last - first, 2),
    }


def pickup_cell(system: Any, samples: int) -> dict[str, Any]:
    system.reset()
    system.close()
    jitter = random.Random(0)
    latencies = []
    with Fleet(
        system.worker_commands(system.pickup_config, system.variants[0]), system.worker_env()
    ) as fleet:
        # the first job waits for the worker to start; a few more warm it up
        for i in range(samples + 3):
            committed = system.burst("P", [i], system.variants[0])
            got = fleet.stamps.wait_for([("P", i)], 60)
            fleet.check()
            if got is None:
                raise BenchError(f"{system.name}: pickup job {i} did not run within 60 s")
            if i >= 3:
                latencies.append(1000 * (got[0] - committed))
            bar("pickup", (i + 1) / (samples + 3))
            time.sleep(0.1 + jitter.uniform(0, 0.1))
    system.reset()
    return _latency_figures(latencies)


def _latency_figures(latencies: Sequence[float]) -> dict[str, Any]:
    return {
        "samples": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p90_ms": round(percentile(latencies, 90), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(max(latencies), 2),
        # every sample, so that rounds can be pooled (``--baseline``)
        "latencies_ms": [round(v, 3) for v in latencies],
    }


def fairness_cell(
    system: Any,
    variant: str,
    backlog: int,
    config: WorkerConfig,
    sizes: Sizes,
    spread: int = 0,
) -> dict[str, Any]:
    """A's backlog, then B's bursts of 10 (scenario ``fairness``); with ``spread``, A's
    backlog is spread over that many keys and B's bursts go to one key of hers (``sybil``)."""
    system.reset()
    load_began = time.monotonic()
    system.load_backlog(Backlog(("A",), backlog, keys=(spread,) if spread else ()), variant)
    load_s = time.monotonic() - load_began
    system.close()
    b_key = system.key("B", 0) if spread else None
    timeout = sizes.big_timeout if backlog >= 100_000 else sizes.fairness_timeout
    env = {**system.worker_env(), STAMP_ALL_ENV: "1"}
    bursts: list[tuple[float, list[float]]] = []  # (B's commit, its jobs' starts)
    timed_out = 0
    note = ""
    began = time.monotonic()
    with Fleet(system.worker_commands(config, variant), env) as fleet:
        a = fleet.stamps.a_times
        deadline = time.monotonic() + timeout
        # the workers are draining A: 20 of its jobs started, or one and 5 s passed (a
        # tenant lock runs one of A's jobs at a time)
        settled = time.monotonic() + 5
        while len(a) < min(backlog // 100 + 1, 20) and not (a and time.monotonic() > settled):
            fleet.check()
            if time.monotonic() > deadline:
                note = f"none of A's jobs started in {timeout:.0f} s"
                break
            time.sleep(0.01)
        time.sleep(sizes.fairness_pause)
        for r in range(sizes.fairness_rounds if not note else 0):
            if len(a) >= backlog - config.processes * (config.concurrency + config.prefetch):
                break  # A has (almost) nothing left: B would be measured on an idle queue
            if r and time.monotonic() - began > timeout:
                break  # enough rounds for a slow system
            seqs = [r * sizes.fairness_burst + j for j in range(sizes.fairness_burst)]
            committed = system.burst("B", seqs, variant, key=b_key)
            got = fleet.stamps.wait_for([("B", s) for s in seqs], timeout)
            fleet.check()
            if got is None:
                timed_out += 1
                note = f"B's burst not run within {timeout:.0f} s"
                break
            bursts.append((committed, got))
            bar(f"fairness {variant} {backlog:,}", (r + 1) / sizes.fairness_rounds)
            time.sleep(sizes.fairness_pause)
        time.sleep(0.5)  # A's starts after B's last, for Jain's index
        a_times = sorted(a)
    system.end_sessions()  # a worker's query may outlive it (and block the reset)
    system.reset()
    waits = [1000 * (t - committed) for committed, got in bursts for t in got]
    a_before: list[int] = []
    jains: list[float] = []
    held = config.processes * (config.concurrency + config.prefetch)
    for committed, got in bursts:
        a_after = [t for t in a_times if t >= committed]
        a_before.append(sum(1 for t in a_after if t <= max(got)))
        # Jain's index over the first 2 x burst jobs the queue chose after B's commit (both
        # tenants had work): 1.0 when B got half of them, 0.5 when one tenant got them all.
        # The first P x (C + prefetch) of A's jobs to start may have been taken before the
        # commit (a worker holds up to that many): not the queue's choice after it, skipped.
        want = 2 * len(got)
        first = sorted([(t, "A") for t in a_after[held : held + want]] + [(t, "B") for t in got])
        b_share = sum(1 for _, who in first[:want] if who == "B")
        jains.append(jain_index([min(len(first), want) - b_share, b_share]))
    a_rate = (len(a_times) - 1) / (a_times[-1] - a_times[0]) if len(a_times) > 1 else 0.0
    return {
        "variant": variant,
        "a_backlog": backlog,
        "a_keys": spread or 1,
        "workers": config.label,
        "rounds": len(bursts) + timed_out,
        "timed_out": timed_out,
        "timeout_s": timeout,
        "note": note,
        "b_p50_ms": round(percentile(waits, 50), 1) if waits else None,
        "b_p99_ms": round(percentile(waits, 99), 1) if waits else None,
        "b_max_ms": round(max(waits), 1) if waits else None,
        "a_before_b_max": max(a_before) if a_before else None,
        "jain_min": round(min(jains), 3) if jains else None,
        "a_rate": round(a_rate, 1),
        "a_started": len(a_times),
        "load_s": round(load_s, 1),
    }


#: The timeshare scenario: seconds each tenant's job runs, and the workers every system gets.
TIMESHARE_WORK = {"A": 0.2, "B": 0.005}
TIMESHARE_CONFIG = WorkerConfig(2, 4)
#: The weights scenario: B weighs 3 against A's 1, by time, with shorter jobs than A's.
WEIGHTS_WORK = {"A": 0.1, "B": 0.02}
WEIGHTS = {"A": 1, "B": 3}
#: The bursts scenario: A's background jobs; the tenants' jobs take 5-50 ms each.
BURSTS_A_WORK = 0.02
BURSTS_WORK_RANGE = (0.005, 0.05)


def _work_env(work: dict[str, float]) -> str:
    return ",".join(f"{k}={v}" for k, v in work.items())


def _starvation(starts: Sequence[float], since: float, until: float) -> float:
    """The longest gap (s) between a tenant's job starts within [since, until], counting
    from ``since`` to its first start and from its last start to ``until``."""
    ts = sorted(t for t in starts if since <= t <= until)
    edges = [since, *ts, until]
    return max(b - a for a, b in itertools.pairwise(edges))


def timeshare_cell(
    system: Any,
    variant: str,
    backlog: int,
    sizes: Sizes,
    work: dict[str, float] = TIMESHARE_WORK,
    weights: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Both tenants backlogged, jobs of ``work`` seconds: shares of worker time (scenario
    ``timeshare``: A 200 ms, B 5 ms; ``weights``: B weighs 3, A 1, by time)."""
    system.reset()
    load_began = time.monotonic()
    system.load_backlog(Backlog(("A", "B"), backlog, chunk=sizes.timeshare_chunk), variant)
    for tenant, weight in (weights or {}).items():
        if weight != 1:
            system.set_weight(system.key(tenant), weight)
    load_s = time.monotonic() - load_began
    system.close()
    weights = weights or {k: 1 for k in work}
    env = {
        **system.worker_env(),
        STAMP_ALL_ENV: "1",
        WORK_ENV: _work_env(work),
        "COMPARE_FAIRNESS": "time" if variant == "by-time" else "count",
    }
    note = ""
    with Fleet(system.worker_commands(TIMESHARE_CONFIG, variant), env) as fleet:
        starts = fleet.stamps.starts
        deadline = time.monotonic() + 60
        while not (starts.get("A") and starts.get("B")):  # both tenants started
            fleet.check()
            if time.monotonic() > deadline:
                note = "one tenant had not started within 60 s"
                break
            time.sleep(0.01)
        began = time.time()
        end = began + sizes.timeshare_window
        while time.time() < end:
            fleet.check()
            bar(f"timeshare {variant}", (time.time() - began) / sizes.timeshare_window)
            time.sleep(0.1)
        # the last 80 % of the window: past the start-up and the first estimates
        lo = began + 0.2 * sizes.timeshare_window
        within = {k: [t for t in starts.get(k, []) if lo <= t <= end] for k in work}
    system.end_sessions()  # a worker's query may outlive it (and block the reset)
    system.reset()
    counts = {k: len(v) for k, v in within.items()}
    spent = {k: counts[k] * work[k] for k in work}
    total = sum(spent.values()) or 1.0
    starved = {k: _starvation(within[k], lo, end) for k in work}
    whose = max(starved, key=lambda k: starved[k])
    return {
        "variant": variant,
        "backlog": backlog,
        "workers": TIMESHARE_CONFIG.label,
        "work_ms": {k: round(1000 * v) for k, v in work.items()},
        "weights": weights,
        "a_jobs": counts["A"],
        "b_jobs": counts["B"],
        "a_time_share": round(spent["A"] / total, 3),
        "b_time_share": round(spent["B"] / total, 3),
        # Jain's index over each tenant's worker time (count) divided by its weight; none
        # when no job started in the window (no shares to judge)
        "jain_time": round(jain_index([spent[k] / weights[k] for k in work]), 3)
        if any(counts.values())
        else None,
        "jain_count": round(jain_index([counts[k] / weights[k] for k in work]), 3)
        if any(counts.values())
        else None,
        "starved_ms": round(1000 * starved[whose], 1),
        "starved": whose,
        "note": note,
        "load_s": round(load_s, 1),
    }


def bursts_plan(sizes: Sizes) -> list[tuple[float, str, int, float]]:
    """The bursts scenario's tenants: (arrival after the start, name, jobs, seconds per job),
    the same for every system (a fixed seed)."""
    rng = random.Random(2026)
    plan = []
    for i in range(sizes.bursts_tenants):
        size = rng.randint(1, sizes.bursts_max)
        duration = round(rng.uniform(*BURSTS_WORK_RANGE), 3)
        plan.append((rng.uniform(0, 0.6 * sizes.bursts_window), f"t{i:02d}", size, duration))
    return sorted(plan)


def bursts_cell(system: Any, variant: str, backlog: int, sizes: Sizes) -> dict[str, Any]:
    """A's backlog of 20 ms jobs keeps every worker busy; the tenants of :func:`bursts_plan`
    arrive meanwhile, each queueing its jobs in one transaction. Each tenant's completion time
    (its last job's start plus its duration, minus its commit) over its completion time under
    the ideal fair schedule
    (:func:`django_fairqueue.contrib.bench.figures.fair_completion_times`: the
    workers split equally among the tenants with work, A always among them)."""
    system.reset()
    load_began = time.monotonic()
    system.load_backlog(Backlog(("A",), backlog), variant)
    load_s = time.monotonic() - load_began
    system.close()
    plan = bursts_plan(sizes)
    work = {"A": BURSTS_A_WORK, **{name: d for _, name, _, d in plan}}
    timeout = sizes.big_timeout if backlog >= 100_000 else sizes.fairness_timeout
    env = {**system.worker_env(), STAMP_ALL_ENV: "1", WORK_ENV: _work_env(work)}
    committed: dict[str, float] = {}
    note = ""
    with Fleet(system.worker_commands(TIMESHARE_CONFIG, variant), env) as fleet:
        starts = fleet.stamps.starts
        deadline = time.monotonic() + 60
        while not starts.get("A"):
            fleet.check()
            if time.monotonic() > deadline:
                raise BenchError("A's jobs had not started within 60 s")
            time.sleep(0.01)
        began = time.time()
        for at, name, size, _ in plan:
            delay = began + at - time.time()
            if delay > 0:
                time.sleep(delay)
            committed[name] = system.burst(name, list(range(size)), variant)
            fleet.check()
            bar(f"bursts {variant} {backlog:,}", at / (0.6 * sizes.bursts_window))
        keys = [(name, s) for _, name, size, _ in plan for s in range(size)]
        if fleet.stamps.wait_for(keys, timeout) is None:
            note = f"not every tenant served within {timeout:.0f} s of the last arrival"
        ended = time.time()
        time.sleep(0.2)
        times = dict(fleet.stamps.times)
        a_starts = list(starts.get("A", []))
    system.end_sessions()  # a worker's query may outlive it (and block the reset)
    system.reset()
    jobs: dict[str, tuple[float, float, float]] = {}
    slowdowns: dict[str, float] = {}
    waits: list[float] = []
    starved: dict[str, float] = {}
    unserved = 0
    finish: dict[str, float] = {}
    for _, name, size, duration in plan:
        got = sorted(times[(name, s)] for s in range(size) if (name, s) in times)
        waits += [1000 * (t - committed[name]) for t in got]
        jobs[name] = (committed[name] - began, size * duration, size)
        if len(got) < size:
            unserved += 1
            finish[name] = ended  # a lower bound: not done when the cell gave up
            starved[name] = _starvation(got, committed[name], ended)
        else:
            finish[name] = got[-1] + duration
            starved[name] = _starvation(got, committed[name], got[-1])
    # Imported here, not at the top: `--baseline REF` runs this harness on the package of an
    # earlier REF, which may not have it (its enqueue cells never come here).
    from django_fairqueue.contrib.bench.figures import fair_completion_times

    ideal = fair_completion_times(
        TIMESHARE_CONFIG.processes * TIMESHARE_CONFIG.concurrency, jobs, background=True
    )
    for name, (arrival, _, _) in jobs.items():
        slowdowns[name] = (finish[name] - began - arrival) / max(ideal[name] - arrival, 1e-3)
    values = list(slowdowns.values())
    whose = max(starved, key=lambda k: starved[k])
    last = max(finish.values())
    a_time = BURSTS_A_WORK * sum(1 for t in a_starts if began <= t <= last)
    burst_time = sum(work[name] for name, _ in times if name in committed)
    return {
        "variant": variant,
        "backlog": backlog,
        "workers": TIMESHARE_CONFIG.label,
        "tenants": len(plan),
        "jobs": len(keys),
        "unserved": unserved,
        "slowdown_mean": round(statistics.fmean(values), 2),
        "slowdown_p50": round(percentile(values, 50), 2),
        "slowdown_max": round(max(values), 2),
        "worst": max(slowdowns, key=lambda k: slowdowns[k]),
        # equally slowed down (whatever the factor) is fair: Jain over ideal / actual
        "jain_slowdown": round(jain_index([1 / v for v in values]), 3),
        "wait_p50_ms": round(percentile(waits, 50), 1) if waits else None,
        "wait_p99_ms": round(percentile(waits, 99), 1) if waits else None,
        "starved_ms": round(1000 * starved[whose], 1),
        "starved": whose,
        # A's share of worker time from the first arrival to the last completion
        "a_time_share": round(a_time / (a_time + burst_time), 3) if a_time + burst_time else None,
        "note": note,
        "load_s": round(load_s, 1),
    }


class Watch:
    """CPU cores other processes used during a cell (django_fairqueue.contrib.bench.harness)."""

    def __init__(self, dbname: str) -> None:
        try:
            from django_fairqueue.contrib.bench.harness import CpuWatch
        except ImportError:  # ``--baseline`` at a commit before the bench app had its name
            from django_fairqueue.benchmark.harness import CpuWatch  # type: ignore[no-redef]

        self.watch = CpuWatch(dbname)

    def __call__(self, cell: dict[str, Any]) -> dict[str, Any]:
        cell["others_cpu"] = self.watch.stop()
        cell["load1"] = round(os.getloadavg()[0], 2)
        return cell

    def start(self) -> None:
        self.watch.start()


def run_system(
    name: str,
    dsn: str,
    sizes: Sizes,
    scenarios: Sequence[str] = SCENARIOS,
    configs: Sequence[WorkerConfig] = (),
) -> dict[str, Any]:
    """Run ``scenarios`` for one system. A scenario left out is an empty list (``pickup``:
    None) in the result, which the report skips. The end-to-end sweep is ``configs`` (empty:
    the system's own). Fairness runs on the best end-to-end configuration, or on the system's
    ``fair_config`` when e2e was left out."""
    system = load_system(name, dsn)
    watch = Watch(str(dsn_fields(dsn)["dbname"]))
    say(f"== {name} ({system.version})")
    system.setup()
    result: dict[str, Any] = {
        "system": name,
        "version": system.version,
        "concurrency_unit": system.concurrency_unit,
        "wakeup": system.wakeup,
        "variants": list(system.variants),
        "scenarios": [s for s in SCENARIOS if s in scenarios],
        "enqueue": [],
        "e2e": [],
        "pickup": None,
        "fairness": [],
        "sybil": [],
        "timeshare": [],
        "weights": [],
        "bursts": [],
    }
    if "enqueue" in scenarios:
        cells = []
        for mode in ("single", "batch"):
            for processes in sizes.enqueue_processes:
                watch.start()
                cell = watch(enqueue_cell(system, mode, processes, sizes))
                say(f"  enqueue {mode} x{processes}: {cell['rate']:,.0f} jobs/s")
                cells.append(cell)
        result["enqueue"] = cells

    if not configs:
        configs = list(system.configs)
        if sizes.e2e_configs:
            configs = configs[: sizes.e2e_configs]
    best_config = sizes.fair_workers or system.fair_config or configs[0]
    if "e2e" in scenarios:
        e2e = []
        rate, capacity = sizes.e2e_first_guess, 1
        for config in configs:
            guess = rate * max(1.0, config.processes * config.concurrency / capacity) ** 0.5
            backlog = int(min(sizes.e2e_max, max(sizes.e2e_min, guess * sizes.e2e_seconds)))
            watch.start()
            cell = watch(e2e_cell(system, config, backlog, system.variants[0]))
            say(f"\r  e2e {config.label}: {cell['rate']:,.0f} jobs/s ({backlog:,} jobs)")
            e2e.append(cell)
            # the next backlog from the fastest rate measured so far (not the first guess)
            rate = max(c["drain_rate"] for c in e2e)
            capacity = config.processes * config.concurrency
        best = max(e2e, key=lambda c: c["rate"])
        for cell in e2e:
            cell["best"] = cell is best
        result["e2e"] = e2e
        best_config = WorkerConfig(best["processes"], best["concurrency"], best.get("prefetch", 0))

    if "pickup" in scenarios:
        polling = system.wakeup.startswith("polling")
        samples = sizes.pickup_poll_samples if polling else sizes.pickup_samples
        watch.start()
        result["pickup"] = watch(pickup_cell(system, samples))
        say(f"\r  pickup: p50 {result['pickup']['p50_ms']} ms, p99 {result['pickup']['p99_ms']} ms")

    for scenario, spread in (("fairness", 0), ("sybil", sizes.sybil_keys)):
        if scenario not in scenarios:
            continue
        cells = []
        if scenario == "sybil":
            backlogs = sizes.sybil_backlogs
        else:
            backlogs = (
                sizes.fairness_backlogs if name == "django-fairqueue" else sizes.peer_backlogs
            )
        for variant in system.variants:
            for backlog in backlogs:
                watch.start()
                try:
                    cell = watch(
                        fairness_cell(system, variant, backlog, best_config, sizes, spread)
                    )
                except Exception as exc:  # one cell's failure must not lose the others
                    say(f"\r  {scenario} {variant} A={backlog:,} failed: {exc}")
                    continue
                say(
                    f"\r  {scenario} {variant} A={backlog:,}: B p50 {cell['b_p50_ms']} ms, "
                    f"p99 {cell['b_p99_ms']} ms, Jain {cell['jain_min']}, load {cell['load1']}"
                    + (f" ({cell['note']})" if cell["note"] else "")
                )
                cells.append(cell)
        result[scenario] = cells

    for scenario in ("timeshare", "weights"):
        if scenario not in scenarios or (scenario == "weights" and not system.weights):
            continue
        cells = []
        variants = getattr(system, "timeshare_variants", system.variants)
        if scenario == "weights":
            variants = ("by-time",)
        for variant in variants:
            for backlog in sizes.timeshare_backlogs:
                watch.start()
                try:
                    if scenario == "weights":
                        cell = timeshare_cell(
                            system, variant, backlog, sizes, WEIGHTS_WORK, WEIGHTS
                        )
                    else:
                        cell = timeshare_cell(system, variant, backlog, sizes)
                    cell = watch(cell)
                except Exception as exc:  # one cell's failure must not lose the others
                    say(f"\r  {scenario} {variant} {backlog:,} failed: {exc}")
                    continue
                say(
                    f"\r  {scenario} {variant} {backlog:,}: A {cell['a_time_share']:.2f} / B "
                    f"{cell['b_time_share']:.2f} of worker time, Jain time {cell['jain_time']}, "
                    f"count {cell['jain_count']}, load {cell['load1']}"
                )
                cells.append(cell)
        result[scenario] = cells

    if "bursts" in scenarios:
        cells = []
        for variant in getattr(system, "timeshare_variants", system.variants):
            for backlog in sizes.bursts_backlogs:
                watch.start()
                try:
                    cell = watch(bursts_cell(system, variant, backlog, sizes))
                except Exception as exc:  # one cell's failure must not lose the others
                    say(f"\r  bursts {variant} {backlog:,} failed: {exc}")
                    continue
                say(
                    f"\r  bursts {variant} {backlog:,}: slowdown mean {cell['slowdown_mean']}, "
                    f"worst {cell['slowdown_max']}, Jain {cell['jain_slowdown']}, "
                    f"load {cell['load1']}" + (f" ({cell['note']})" if cell["note"] else "")
                )
                cells.append(cell)
        result["bursts"] = cells
    system.close()
    return result


# ============================================================================================
# The run: a database per system, a process per system


def server_dsn() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        from django_fairqueue import devdb

        url = devdb.database_url("postgres")
    return dsn_with(url, dbname="postgres")


def _admin(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


def fresh_database(server: str, name: str) -> str:
    with _admin(server) as conn:
        row = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s",
            (name,),
        ).fetchone()
        if row is not None:
            if row[0] != MARK:
                raise BenchError(f"database {name!r} exists and is not this benchmark's")
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
        conn.execute(f"COMMENT ON DATABASE \"{name}\" IS '{MARK}'")
    return dsn_with(server, dbname=name)


def drop_database(server: str, name: str) -> None:
    with _admin(server) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def describe(server: str) -> dict[str, Any]:
    with _admin(server) as conn:
        settings = {
            s: str(conn.execute(f"SHOW {s}").fetchone()[0])  # type: ignore[index]
            for s in SERVER_SETTINGS
        }
    from django_fairqueue.contrib.bench.runner import git_checkout  # Django is set up

    return {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.compare.run", *sys.argv[1:]]),
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "psycopg": psycopg.__version__,
        },
        "server": settings,
        "server_host": dsn_fields(server).get("host", ""),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "git": git_checkout(ROOT),
    }


def worker_config(text: str) -> WorkerConfig:
    """``PxC`` or ``PxC+F`` (``--config``): P processes of C, prefetch F."""
    try:
        sizes, plus, prefetch = text.partition("+")
        processes, concurrency = (int(v) for v in sizes.split("x"))
        config = WorkerConfig(processes, concurrency, int(prefetch) if plus else 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not PxC or PxC+F (e.g. 1x32+64)") from None
    if processes < 1 or concurrency < 1 or config.prefetch < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: P and C from 1, F from 0")
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``scenarios`` is the ``--scenario`` choices in running order."""
    parser = argparse.ArgumentParser(prog="compare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--system", action="append", choices=SYSTEMS, help="repeatable; default all"
    )
    parser.add_argument("--sizes", choices=list(PRESETS), default="full")
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="repeatable; default all (the enqueue cells alone take about a minute)",
    )
    parser.add_argument(
        "--fair",
        action="store_true",
        help="the fairness scenarios: " + ", ".join(FAIRNESS_SCENARIOS),
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="enqueue rounds, the systems alternating (ratios are taken within a round, "
        "then their median; default 3)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also run django-fairqueue as it was at git REF, alternating with this checkout "
        "round by round (before and after under the same load); the enqueue, e2e and pickup "
        "scenarios only",
    )
    parser.add_argument(
        "--config",
        action="append",
        type=worker_config,
        metavar="PxC[+F]",
        help="repeatable: the end-to-end sweep, for every system (default: each system's own); "
        "+F is django-fairqueue's --prefetch",
    )
    parser.add_argument("--json", help="default: benchmarks/results/compare-<date>.json")
    parser.add_argument("--plots", metavar="DIR", help="write compare-*.png plots there")
    parser.add_argument("--keep", action="store_true", help="keep the databases")
    parser.add_argument(
        "--db-prefix",
        default=DB_PREFIX,
        help=f"each system's database is PREFIX<system> (default {DB_PREFIX})",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one system
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = [*(args.scenario or []), *(FAIRNESS_SCENARIOS if args.fair else ())]
    args.scenarios = [s for s in SCENARIOS if s in (chosen or SCENARIOS)]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.baseline and not set(args.scenarios) <= set(BASELINE_SCENARIOS):
        parser.error(
            "--baseline measures the " + ", ".join(BASELINE_SCENARIOS) + " scenarios only: "
            "name them with --scenario"
        )
    args.configs = args.config or []
    return args


def baseline_commit(ref: str) -> str:
    """The commit git ``ref`` names in this checkout, or BenchError saying why there is none."""
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise BenchError(f"--baseline needs git: {exc}") from None
    if "not a git repository" in found.stderr:
        raise BenchError(f"--baseline needs a git checkout: {ROOT} is not one")
    if found.returncode != 0:
        raise BenchError(f"--baseline {ref}: not a commit of {ROOT}")
    return found.stdout.strip()


def baseline_tree(commit: str) -> Path:
    """A directory to run the baseline from: ``django_fairqueue`` as it was at ``commit`` and
    this checkout's ``benchmarks`` (a link), so the harness is the same for both."""
    tree = Path(tempfile.mkdtemp(prefix="compare-baseline-"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "django_fairqueue"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    (tree / "benchmarks").symlink_to(ROOT / "benchmarks")
    return tree


def run_one_system(
    server: str,
    name: str,
    sizes: str,
    scenarios: Sequence[str],
    keep: bool,
    baseline: tuple[str, Path] | None = None,
    configs: Sequence[WorkerConfig] = (),
) -> dict[str, Any] | None:
    """Run ``scenarios`` for system ``name`` in a process of its own, on a fresh database;
    None if it failed (said on stderr). The baseline runs from ``baseline``'s tree (its
    ``django_fairqueue`` comes first on the path)."""
    dbname = DB_PREFIX + name.replace("-", "_")
    dsn = fresh_database(server, dbname)
    out = Path(f"/tmp/compare-{os.getpid()}-{dbname}.json")
    try:
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.compare.run",
                "--sizes",
                sizes,
                *(a for s in scenarios for a in ("--scenario", s)),
                *(a for c in configs for a in ("--config", c.label)),
                "--one",
                name,
                "--dsn",
                dsn,
                "--out",
                str(out),
            ],
            cwd=baseline[1] if name == BASELINE and baseline else ROOT,
            env={**os.environ, BASELINE_REF_ENV: baseline[0]} if baseline else None,
            check=False,
        ).returncode
        if code != 0:
            say(f"compare: {name} failed (exit {code}); going on without it")
            return None
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        out.unlink(missing_ok=True)
        if not keep:
            drop_database(server, dbname)


def system_rounds(
    server: str,
    names: Sequence[str],
    sizes: str,
    scenarios: Sequence[str],
    rounds: int,
    keep: bool,
    baseline: tuple[str, Path] | None = None,
    configs: Sequence[WorkerConfig] = (),
) -> dict[str, list[dict[str, Any] | None]]:
    """``scenarios`` ``rounds`` times, every system once per round, the order rotated each
    round. A single enqueue is bound by the commit's flush, and a worker's rate by what else
    the two cores run, both of which drift by a factor of two within minutes on a shared
    machine: systems measured minutes apart are not comparable, systems measured in the same
    round are. Per system: each round's result (None for a round it failed)."""
    found: dict[str, list[dict[str, Any] | None]] = {n: [] for n in names}
    order = list(names)
    for n in range(rounds):
        say(f"compare: round {n + 1} of {rounds} ({', '.join(scenarios)})")
        for name in order:
            result = run_one_system(server, name, sizes, scenarios, keep, baseline, configs)
            found[name].append(result)
        order = order[1:] + order[:1]
    return found


def merge_rounds(result: dict[str, Any], rounds: Sequence[dict[str, Any] | None]) -> None:
    """Put the rounds' cells into ``result``: each round's as ``<scenario>_rounds`` (None for
    a round the system failed), and their median (pickup: the samples pooled) in its place."""
    ran = [r for r in rounds if r is not None]
    if any(r["enqueue"] for r in ran):
        result["enqueue_rounds"] = [None if r is None else r["enqueue"] for r in rounds]
        result["enqueue"] = median_cells(result["enqueue_rounds"])
    if any(r["e2e"] for r in ran):
        result["e2e_rounds"] = [None if r is None else r["e2e"] for r in rounds]
        result["e2e"] = median_e2e(result["e2e_rounds"])
    if any(r["pickup"] for r in ran):
        result["pickup_rounds"] = [None if r is None else r["pickup"] for r in rounds]
        result["pickup"] = pooled_pickup(result["pickup_rounds"])
    result["scenarios"] = sorted(
        {s for r in ran for s in r["scenarios"]} | set(result["scenarios"]), key=SCENARIOS.index
    )


def median_e2e(rounds: Sequence[list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
    """One end-to-end cell per configuration: the median of its rates over the rounds that
    ran it (the rest of the cell from its first round), the best marked again."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for cells in rounds:
        for c in cells or []:
            by_label.setdefault(c["label"], []).append(c)
    merged = []
    for cells in by_label.values():
        cell = dict(cells[0])
        for key in ("rate", "drain_rate", "startup_s"):
            cell[key] = round(statistics.median(c[key] for c in cells), 2)
        cell["rounds"] = len(cells)
        merged.append(cell)
    best = max(merged, key=lambda c: c["rate"])
    for cell in merged:
        cell["best"] = cell is best
    return merged


def pooled_pickup(rounds: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """The pickup latencies of every round as one sample."""
    cells = [c for c in rounds if c is not None]
    latencies = [v for c in cells for v in c["latencies_ms"]]
    return {**_latency_figures(latencies), "rounds": len(cells)}


def median_cells(rounds: Sequence[list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
    """One cell per (mode, processes): its median rate over the rounds that ran it."""
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for cells in rounds:
        for c in cells or []:
            by_key.setdefault((c["mode"], c["processes"]), []).append(c)
    merged = []
    for (mode, processes), cells in by_key.items():
        rate = statistics.median(c["rate"] for c in cells)
        merged.append(
            {"mode": mode, "processes": processes, "rate": round(rate, 1), "rounds": len(cells)}
        )
    return merged


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; a BenchError (a run that cannot go on) ends it with one line on
    stderr and status 2, not a traceback."""
    try:
        return _main(argv)
    except BenchError as exc:
        say(f"compare: {exc}")
        return 2


def _main(argv: list[str] | None) -> int:
    global DB_PREFIX
    args = parse_args(argv)
    # Before the server and minutes of work: a --baseline that cannot run.
    commit = baseline_commit(args.baseline) if args.baseline else ""
    sizes = PRESETS[args.sizes]
    DB_PREFIX = args.db_prefix
    scenarios = args.scenarios

    if args.one:
        result = run_system(args.one, args.dsn, sizes, scenarios, args.configs)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0

    server = server_dsn()
    setup_django(server)  # for the plots (django_fairqueue.contrib.bench)
    from benchmarks.compare import report

    meta = describe(server)
    meta["sizes"] = asdict(sizes)
    meta["scenarios"] = scenarios
    say(f"compare: server {dsn_url(server)}, load {meta['load_average_before'][0]:.2f}")
    results = []
    began = time.monotonic()
    names = list(args.system or SYSTEMS)
    baseline = None
    if args.baseline:
        baseline = (args.baseline, baseline_tree(commit))
        meta["baseline"] = args.baseline
        names.append(BASELINE)
    rounds: dict[str, list[dict[str, Any] | None]] = {}
    in_rounds = [s for s in scenarios if s in (BASELINE_SCENARIOS if baseline else ROUND_SCENARIOS)]
    rest = [s for s in scenarios if s not in in_rounds]
    if in_rounds and (args.rounds > 1 or baseline):
        try:
            rounds = system_rounds(
                server,
                names,
                args.sizes,
                in_rounds,
                args.rounds,
                args.keep,
                baseline,
                args.configs,
            )
        finally:
            if baseline:
                shutil.rmtree(baseline[1], ignore_errors=True)
    else:
        rest = list(scenarios)
    for name in names:
        ran = [r for r in rounds.get(name, []) if r is not None]
        if rest:
            result = run_one_system(server, name, args.sizes, rest, args.keep, None, args.configs)
        else:
            result = ran[-1] if ran else None
        if result is None:
            continue
        if ran:
            merge_rounds(result, rounds[name])
        results.append(result)
    meta["wall_seconds"] = round(time.monotonic() - began, 1)
    meta["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    doc = {"meta": meta, "systems": results}
    doc["goals"] = report.goals(doc)
    print(report.tables(doc))
    path = Path(
        args.json or ROOT / "benchmarks" / "results" / f"compare-{datetime.now(UTC):%Y-%m-%d}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nresults written to {path}")
    if args.plots:
        print("\n".join(plot_lines(doc, Path(args.plots))))
    return 0


def plot_lines(doc: dict[str, Any], directory: Path) -> list[str]:
    """Draw the run's plots into ``directory``; a line for each, or one saying none was."""
    from benchmarks.compare import report  # after setup_django, as main's import

    drawn = report.plots(doc, directory)
    if not drawn:
        return [f"no plot written to {directory}: {report.PLOTTED}"]
    return [f"plot written to {written}" for written in drawn]


if __name__ == "__main__":
    sys.exit(main())
