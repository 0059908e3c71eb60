"""Fairness by count and by time, side by side: five workloads, each in both modes.

Worker processes claim (``fairness="count"`` or ``"time"``), "run" each message by sleeping
its channel's task duration, and settle it reporting that duration; worker 0 also folds the
counter deltas twice a second, as the workers' maintenance loop does. Times are the claimers'
clocks (one machine); a message's wait is from its ``enqueued_at`` (the server's clock at
enqueue) to the return of the claim that took it.

* ``flood``: bob's backlog in one channel, then alice enqueues 10 messages (several rounds):
  alice's wait.
* ``sybil``: bob's backlog spread over 100 channels of his channel group (``bob/c00`` ...
  ``bob/c99``), alice 10 in one channel of hers (``alice/c00``): the claim is fair across
  groups first, so bob's hundred channels weigh as one tenant.
* ``heavy``: bob's tasks take 200 ms, alice's 5 ms, both backlogged: each one's share of
  worker time.
* ``weights``: alice weight 3 with 20 ms tasks, bob weight 1 with 100 ms tasks: the shares of
  worker time should be 3:1.
* ``bursts``: bob's backlog (20 ms tasks) and 50 tenants arriving at random moments with
  random numbers of 5-50 ms tasks: each tenant's completion time against the ideal fair
  schedule (:func:`~django_fairqueue.contrib.bench.figures.fair_completion_times`: processor
  sharing, the
  workers split equally among the tenants with work, bob always among them, none given more
  workers than it has messages).
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.synchronize import Barrier, Event

from django.db import connections

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench.figures import fair_completion_times, jain_index, percentile
from django_fairqueue.contrib.bench.harness import START_TIMEOUT, Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store, message_store

LEASE = timedelta(minutes=10)
WORKLOADS = ("flood", "sybil", "heavy", "weights", "bursts")
MODES = ("count", "time")
FOLD_EVERY = 0.5  # seconds, worker 0 (the maintenance loop folds about once a second)
SERVE_TIMEOUT = 60.0


@dataclass(frozen=True)
class TimeshareCell:
    workload: str
    backlog: int
    fairness: str

    @property
    def label(self) -> str:
        return f"timeshare {self.workload:<8} backlog {self.backlog:>9,}  by {self.fairness}"


@dataclass(frozen=True)
class TimeshareResult:
    workload: str
    backlog: int
    fairness: str
    workers: int
    seconds: float
    #: the workload's main figure: Jain over counts (flood, sybil), over worker time (heavy,
    #: weights), over ideal / actual completion (bursts)
    jain: float
    #: Jain's index over the tenants' worker time (divided by weight), and over their counts
    jain_time: float | None
    jain_count: float | None
    #: the share of worker time of each tenant, "alice 0.50 / bob 0.50" (weights: as measured)
    shares: str
    #: the small tenant's (alice's) wait, claim return minus enqueue, ms
    small_wait_p50_ms: float | None
    small_wait_p99_ms: float | None
    #: the longest a tenant with ready messages went without one claimed, ms
    worst_starvation_ms: float
    #: whose (a burst tenant's name, or alice, or bob)
    starved: str
    #: bursts: completion time over the ideal fair schedule's, per tenant (p50 and worst)
    slowdown_p50: float | None
    slowdown_max: float | None
    load1: float
    #: ... and their mean
    slowdown_mean: float | None = None


def plan(sizes: Sizes) -> list[TimeshareCell]:
    return [
        TimeshareCell(w, n, mode)
        for w in sizes.timeshare_workloads
        for n in sizes.timeshare_backlogs
        for mode in MODES
        if n == min(sizes.timeshare_backlogs) or w in sizes.timeshare_big_workloads
    ]


#: One message as a worker saw it: (tenant channel, enqueued_at, claim started, claim
#: returned, seconds it ran, finished)
Seen = tuple[str, float, float, float, float, float]


def _worker(
    index: int,
    using: str,
    fairness: str,
    batch: int,
    durations: dict[str, float],
    stop: Event,
    start: Barrier,
) -> list[Seen]:
    worker_id = f"timeshare-{os.getpid()}"
    seen: list[Seen] = []
    next_fold = time.monotonic() + FOLD_EVERY
    start.wait(START_TIMEOUT)
    while not stop.is_set():
        if index == 0 and time.monotonic() >= next_fold:
            channel_store.fold_channel_deltas(10_000, fairness=fairness, using=using)
            next_fold = time.monotonic() + FOLD_EVERY
        started = time.time()
        got = message_store.claim_messages(
            batch, lease=LEASE, worker_id=worker_id, fairness=fairness, using=using
        )
        returned = time.time()
        if not got:
            time.sleep(0.002)
            continue
        runs = []
        for m in got:
            d = durations.get(m.channel, durations.get(m.channel.split("-")[0], 0.0))
            t0 = time.monotonic()
            if d > 0:
                time.sleep(d)
            ran = time.monotonic() - t0
            runs.append(ran)
            seen.append((m.channel, m.enqueued_at.timestamp(), started, returned, ran, time.time()))
        message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got], run_seconds=runs, using=using
        )
    return seen


def tenant(channel: str) -> str:
    """bob's channels are ``bob``, ``bob/c17`` (sybil): the tenant is the first word."""
    return channel.split("/")[0].split("-")[0]


def _shares(
    seen: list[Seen], since: float, until: float, weights: dict[str, int]
) -> tuple[dict[str, float], dict[str, int]]:
    """Worker time and counts per tenant of the messages claimed within [since, until]."""
    spent: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ch, _, _, returned, ran, _ in seen:
        if since <= returned <= until:
            spent[tenant(ch)] += ran
            counts[tenant(ch)] += 1
    return dict(spent), dict(counts)


def _starvation(seen: list[Seen], busy: dict[str, tuple[float, float]]) -> tuple[float, str]:
    """The longest gap (s) between claims of a tenant while it had work (from its arrival, or
    the window's start, to its first claim, and between consecutive claims), and whose."""
    times: dict[str, list[float]] = defaultdict(list)
    for ch, _, _, returned, _, _ in seen:
        times[tenant(ch)].append(returned)
    worst, whose = 0.0, ""
    for who, (arrived, until) in busy.items():
        ts = sorted(t for t in times.get(who, []) if arrived <= t <= until)
        prev = arrived
        for t in ts:
            if t - prev > worst:
                worst, whose = t - prev, who
            prev = t
    return worst, whose


def run(bench: Bench, cell: TimeshareCell) -> TimeshareResult:
    sizes = bench.sizes
    load = load1()
    bench.reset()
    workers = sizes.timeshare_workers
    batch = 1
    weights: dict[str, int] = {"alice": 1, "bob": 1}
    durations: dict[str, float] = {}
    rng = random.Random(2026)
    w = cell.workload
    alice = "alice"
    if w in ("flood", "sybil"):
        batch = sizes.fairness_batch
        workers = 2
        bob = ["bob"]
        if w == "sybil":
            channel_store.ensure_groups(["alice", "bob"], using=bench.using)
            bob = [f"bob/c{i:02d}" for i in range(100)]
            alice = "alice/c00"
        bench.load(bob, cell.backlog)
    elif w == "heavy":
        durations = {"bob": 0.2, "alice": 0.005}
        bench.load(["bob", "alice"], cell.backlog)
    elif w == "weights":
        durations = {"bob": 0.1, "alice": 0.02}
        weights = {"alice": 3, "bob": 1}
        bench.load(["bob", "alice"], cell.backlog)
        store_weight("alice", 3, bench.using)
    else:  # bursts
        durations = {"bob": 0.02}
        bench.load(["bob"], cell.backlog)
    window = sizes.timeshare_window
    bursts: list[tuple[str, float, list[int]]] = []  # (tenant, committed, ids)
    plan_bursts: list[tuple[float, str, int, float]] = []
    if w == "bursts":
        n = sizes.timeshare_tenants
        for i in range(n):
            name = f"t{i:02d}"
            size = rng.randint(1, sizes.timeshare_burst_max)
            durations[name] = round(rng.uniform(0.005, 0.05), 3)
            plan_bursts.append((rng.uniform(0, window * 0.6), name, size, durations[name]))
        plan_bursts.sort()
    with bench.processes() as group:
        stop = group.event()
        start = group.barrier(workers + 1)
        group.start(workers, _worker, bench.using, cell.fairness, batch, durations, stop, start)
        start.wait(START_TIMEOUT)
        began = time.time()
        try:
            if w in ("flood", "sybil"):
                time.sleep(sizes.fairness_pause)
                for r in range(sizes.fairness_rounds):
                    # The time before the enqueue: a worker may claim (and stamp) a message
                    # before this process gets back from its commit.
                    sent = time.time()
                    ids = enqueue_many(
                        EnqueueRequest(NOOP_TASK_NAME, (r, j), channel=alice)
                        for j in range(sizes.fairness_burst)
                    )
                    bursts.append((alice, sent, ids))
                    _wait_claimed(bench.using, alice)
                    time.sleep(sizes.fairness_pause)
            elif w == "bursts":
                for at, name, size, _ in plan_bursts:
                    delay = began + at - time.time()
                    if delay > 0:
                        time.sleep(delay)
                    sent = time.time()  # (as above)
                    ids = enqueue_many(
                        EnqueueRequest(NOOP_TASK_NAME, (j,), channel=name) for j in range(size)
                    )
                    bursts.append((name, sent, ids))
                for name, _, _ in bursts:
                    _wait_claimed(bench.using, name)
                time.sleep(max(durations.values()) + 0.1)
            else:
                time.sleep(window)
        finally:
            stop.set()
            connections[bench.using].close()
        seen = [s for out in group.collect(timeout=START_TIMEOUT + 30) for s in out]
    ended = time.time()
    bench.reset()

    jain_time: float | None = None
    jain_count: float | None = None
    shares = ""
    wait_p50 = wait_p99 = slow_p50 = slow_max = slow_mean = None
    busy: dict[str, tuple[float, float]] = {}
    if w in ("flood", "sybil"):
        waits = [1000 * (ret - enq) for ch, enq, _, ret, _, _ in seen if ch == alice]
        wait_p50 = round(percentile(waits, 50), 2)
        wait_p99 = round(percentile(waits, 99), 2)
        ends = [c for _, c, _ in bursts[1:]] + [float("inf")]
        for (who, committed, _), end in zip(bursts, ends, strict=True):
            last = max(
                (ret for ch, _, _, ret, _, _ in seen if ch == who and committed <= ret < end),
                default=committed,
            )
            busy[f"{who}@{committed}"] = (committed, last)
        # counts over the windows while alice had work: her 10 vs what bob got meanwhile
        a = b = 0
        for _, committed, _ in bursts:
            last = max(
                (ret for ch, _, _, ret, _, _ in seen if ch == alice and ret >= committed),
                default=committed,
            )
            _, counts = _shares(seen, committed, last, weights)
            a += counts.get("alice", 0)
            b += counts.get("bob", 0)
        jain_count = round(jain_index([a, b]), 3)
        worst = max((b_ - a_ for a_, b_ in busy.values()), default=0.0)
        whose = "alice"
        shares = f"alice {a} / bob {b} msgs while alice waited"
    elif w in ("heavy", "weights"):
        # the middle of the window: both backlogged, past the first estimates
        lo, hi = began + window * 0.2, began + window
        spent, counts = _shares(seen, lo, hi, weights)
        total = sum(spent.values()) or 1.0
        jain_time = round(jain_index([spent.get(k, 0) / weights[k] for k in weights]), 3)
        jain_count = round(jain_index([counts.get(k, 0) / weights[k] for k in weights]), 3)
        shares = " / ".join(f"{k} {spent.get(k, 0) / total:.2f}" for k in sorted(weights))
        worst, whose = _starvation(seen, {k: (lo, hi) for k in weights})
    else:
        finish: dict[str, float] = {}
        for ch, _, _, _, _, fin in seen:
            if ch != "bob":
                finish[ch] = max(finish.get(ch, 0.0), fin)
        jobs = {
            name: (committed - began, len(ids) * durations[name], len(ids))
            for name, committed, ids in bursts
        }
        ideal = fair_completion_times(workers, jobs, background=True)
        slow = [(finish[k] - began - jobs[k][0]) / max(ideal[k] - jobs[k][0], 1e-3) for k in jobs]
        slow_p50 = round(percentile(slow, 50), 2)
        slow_max = round(max(slow), 2)
        slow_mean = round(sum(slow) / len(slow), 2)
        hi = max(finish.values())
        spent, _ = _shares(seen, began, hi, weights)
        # equally slowed down (whatever the factor) is fair: Jain over ideal / actual
        jain_time = round(jain_index([1 / s for s in slow]), 3)
        bob_share = spent.get("bob", 0) / (sum(spent.values()) or 1.0)
        shares = f"bob {bob_share:.2f} of worker time while bursts ran"
        busy = {name: (committed, finish[name]) for name, committed, _ in bursts}
        worst, whose = _starvation(seen, busy)
        waits = [1000 * (ret - enq) for ch, enq, _, ret, _, _ in seen if ch != "bob"]
        wait_p50 = round(percentile(waits, 50), 2)
        wait_p99 = round(percentile(waits, 99), 2)
    return TimeshareResult(
        workload=w,
        backlog=cell.backlog,
        fairness=cell.fairness,
        workers=workers,
        seconds=round(ended - began, 1),
        jain=(jain_count if w in ("flood", "sybil") else jain_time) or 0.0,
        jain_time=jain_time,
        jain_count=jain_count,
        shares=shares,
        small_wait_p50_ms=wait_p50,
        small_wait_p99_ms=wait_p99,
        worst_starvation_ms=round(1000 * worst, 1),
        starved=whose,
        slowdown_p50=slow_p50,
        slowdown_max=slow_max,
        slowdown_mean=slow_mean,
        load1=round(load, 2),
    )


def store_weight(channel: str, weight: int, using: str) -> None:
    from django_fairqueue.models import Channel

    Channel.objects.using(using).filter(name=channel).update(weight=weight)


def _wait_claimed(using: str, channel: str) -> None:
    """Until ``channel`` has no ready message left (the burst just enqueued is claimed: it has
    no other work), or fail the cell. Counters include the deltas not folded yet: exact."""
    (cid,) = channel_store.select_channel_ids([channel], using=using).values()
    deadline = time.monotonic() + SERVE_TIMEOUT
    while True:
        (counters,) = channel_store.select_channel_counters([cid], using=using)
        if not counters.ready:
            return
        if time.monotonic() > deadline:
            raise BenchmarkError(
                f"{counters.ready} messages of {channel} not claimed within {SERVE_TIMEOUT:.0f}s"
            )
        time.sleep(0.002)


def _summary(r: TimeshareResult) -> str:
    if r.jain_time is not None:
        count = f"{r.jain_count:.3f}" if r.jain_count is not None else "-"
        return f"Jain(time) {r.jain_time:.3f}, Jain(count) {count}"
    return f"alice p99 {r.small_wait_p99_ms:.1f} ms"


SCENARIO = Scenario(
    name="timeshare",
    title="Fairness by count and by time: five workloads",
    plan=plan,
    run=run,
    columns=(
        Column("workload", "workload"),
        Column("backlog", "backlog", ","),
        Column("by", "fairness"),
        Column("workers", "workers"),
        Column("s", "seconds", ".1f"),
        Column("Jain time", "jain_time", ".3f"),
        Column("Jain count", "jain_count", ".3f"),
        Column("small p50 ms", "small_wait_p50_ms", ".1f"),
        Column("small p99 ms", "small_wait_p99_ms", ".1f"),
        Column("starved ms", "worst_starvation_ms", ",.0f"),
        Column("whose", "starved"),
        Column("slowdown mean", "slowdown_mean", ".2f"),
        Column("slowdown p50", "slowdown_p50", ".2f"),
        Column("slowdown max", "slowdown_max", ".2f"),
        Column("shares", "shares"),
    ),
    summary=_summary,
    key=("workload", "backlog", "fairness"),
    metric="jain",
    notes=(
        "Workers claim (flood, sybil: 2 processes, batch 10, no-op tasks; the others: "
        "4 processes, batch 1), sleep each message's task duration and settle it reporting "
        "that time; worker 0 folds the counter deltas every 0.5 s (the maintenance loop).",
        "Jain time / count: Jain's index over the tenants' worker time (divided by weight) and "
        "over their counts (divided by weight), 1 = equal; heavy, weights: the last 80 % of "
        "the window; flood, sybil: counts while alice had work (alice vs all of bob); "
        "bursts: Jain time is over each burst tenant's ideal / actual completion time (1: all "
        "slowed down alike), no Jain count.",
        "small p50/p99: alice's wait (flood, sybil) or the burst tenants' (bursts), from "
        "enqueue to the return of the claim that took the message.",
        "starved: the longest a tenant with work went without a message claimed.",
        "slowdown: a burst tenant's completion time over the ideal fair schedule's "
        "(processor sharing: the workers split equally among the tenants with work, bob "
        "included, none given more workers than it has messages).",
        "sybil: bob's 100 channels are one channel group's, alice's channel another's: the "
        "claim shares out between the groups first (groups' own scenario, sybil, has the "
        "ungrouped contrast: alice one channel's share among 101).",
    ),
)
