"""Channel groups: what a claim costs as channels and groups grow, and the sybil tenant.

``groups``: server time and backend CPU per claim (``track_functions``, as ``functions``
measures them) over a standing backlog of ``groups_per_channel`` messages per channel, at 10 to
10,000 channels without groups and at 10,000 channels in 1 to 1,000 groups; each claim is
followed by its completion and as many new messages to the same channels, so the backlog and
the channels' state stay as they were. The claim's cost should not grow with either count
(the target: within 1.2 times the smallest cell of the same batch).

``sybil``: tenant bob spreads his backlog over 100 channels, tenant alice queues 10 messages in
one channel of hers; one claimer takes batches of ``fairness_batch`` and completes them. The
wait of each of alice's messages (her enqueue to the claim that took it) is measured over
several bursts, with the two tenants as channel groups (``grouped``) and, for comparison, with
their 101 channels ungrouped (per-channel fairness, which gives bob 100 turns for alice's one).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench import db, functions
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, backend_cpu, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store, message_store

LEASE = timedelta(minutes=10)
WORKER_ID = "fairbench-groups"


def _names(channels: int, groups: int) -> list[str]:
    """``channels`` channel names, spread round-robin over ``groups`` groups (0: ungrouped)."""
    if not groups:
        return [f"ch-{i:05d}" for i in range(channels)]
    return [f"g{i % groups:04d}/ch-{i:05d}" for i in range(channels)]


# --------------------------------------------------------------------------------------------
# claim cost


@dataclass(frozen=True)
class GroupsCell:
    channels: int
    groups: int
    batch: int

    @property
    def label(self) -> str:
        return (
            f"claim cost  {self.channels:>6,} channels  {self.groups:>5,} groups  "
            f"batch {self.batch}"
        )


@dataclass(frozen=True)
class GroupsResult:
    channels: int
    groups: int
    batch: int
    calls: int
    #: microseconds per claim inside fairqueue_claim_v1 (server time, its callees included)
    claim_us: float
    #: the backend's CPU microseconds per claim (None: unreadable)
    claim_cpu_us: float | None
    #: claim_us over the first cell of the same batch, with groups or without (filled by
    #: finish)
    vs_first: float | None
    load1: float


def plan_cost(sizes: Sizes) -> list[GroupsCell]:
    return [
        GroupsCell(channels, groups, batch)
        for batch in sizes.functions_batches
        for channels, groups in sizes.groups_cells
    ]


def run_cost(bench: Bench, cell: GroupsCell) -> GroupsResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    names = _names(cell.channels, cell.groups)
    if cell.groups:
        channel_store.ensure_groups([f"g{i:04d}" for i in range(cell.groups)], using=using)
    bench.load(names, cell.channels * sizes.groups_per_channel)
    reason = functions.unavailable(using)
    if reason is not None:
        raise BenchmarkError(f"groups: {reason}")
    calls = sizes.groups_samples
    for _ in range(10):  # warm-up: plans cached, statements prepared
        got = message_store.claim_messages(
            cell.batch, lease=LEASE, worker_id=WORKER_ID, using=using
        )
        message_store.release_messages([(m.id, m.lease_token) for m in got], using=using)
    cpu = backend_cpu(using)
    claim_cpu = 0.0
    before = db.select_function_times(using=using)
    for i in range(calls):
        started = cpu() if cpu is not None else 0.0
        got = message_store.claim_messages(
            cell.batch, lease=LEASE, worker_id=WORKER_ID, using=using
        )
        claim_cpu += (cpu() if cpu is not None else 0.0) - started
        if len(got) != cell.batch:
            raise BenchmarkError(f"groups: a claim of {cell.batch} got {len(got)}")
        message_store.complete_messages([(m.id, m.lease_token, None) for m in got], using=using)
        enqueue_many(EnqueueRequest(NOOP_TASK_NAME, channel=m.channel) for m in got)
        if i % 100 == 0:
            bench.progress.update(f"{i:,}/{calls:,} claims", i / calls)
    db.force_stats_flush(using=using)
    after = db.select_function_times(using=using)
    bench.reset()
    return GroupsResult(
        channels=cell.channels,
        groups=cell.groups,
        batch=cell.batch,
        calls=calls,
        claim_us=functions.per_call(before, after, functions.CLAIM, calls),
        claim_cpu_us=round(1e6 * claim_cpu / calls) if cpu is not None else None,
        vs_first=None,
        load1=round(load, 2),
    )


def finish_cost(results: list[GroupsResult]) -> list[GroupsResult]:
    from dataclasses import replace

    first: dict[tuple[int, bool], float] = {}
    out = []
    for r in results:
        base = first.setdefault((r.batch, r.groups > 0), r.claim_us)
        out.append(replace(r, vs_first=round(r.claim_us / base, 2) if base else None))
    return out


SCENARIO = Scenario(
    name="groups",
    title="Claim cost with channel groups (server microseconds per claim)",
    plan=plan_cost,
    run=run_cost,
    columns=(
        Column("channels", "channels", ","),
        Column("groups", "groups", ","),
        Column("batch", "batch"),
        Column("claim µs", "claim_us", ".1f"),
        Column("x first", "vs_first", ".2f"),
        Column("claim CPU µs", "claim_cpu_us", ".0f"),
        Column("calls", "calls", ","),
        Column("load", "load1", ".2f"),
    ),
    summary=lambda r: f"claim {r.claim_us:.1f} µs",
    key=("channels", "groups", "batch"),
    metric="claim_us",
    higher_is_better=False,
    finish=finish_cost,
    unavailable=functions.unavailable,
    notes=(
        "Server time inside fairqueue_claim_v1 per call (pg_stat_user_functions, promote and "
        "fold included), each claim followed by its completion and as many new messages to "
        "the same channels. 'x first': over the first cell of the same batch and kind "
        "(ungrouped, or grouped), the one with fewest channels; the target is at most 1.2.",
    ),
)


# --------------------------------------------------------------------------------------------
# sybil


@dataclass(frozen=True)
class SybilCell:
    backlog: int
    grouped: bool

    @property
    def label(self) -> str:
        how = "grouped" if self.grouped else "ungrouped"
        return f"sybil  backlog {self.backlog:>9,}  {how}"


@dataclass(frozen=True)
class SybilResult:
    backlog: int
    grouped: bool
    samples: int
    #: alice's waits, enqueue to claim (milliseconds)
    wait_p50_ms: float
    wait_p99_ms: float
    wait_max_ms: float
    #: messages of bob claimed while alice's burst waited, per burst (mean)
    bob_per_burst: float
    load1: float


def plan_sybil(sizes: Sizes) -> list[SybilCell]:
    return [
        SybilCell(backlog, grouped) for backlog in sizes.sybil_backlogs for grouped in (True, False)
    ]


def run_sybil(bench: Bench, cell: SybilCell) -> SybilResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    if cell.grouped:
        channel_store.ensure_groups(["alice", "bob"], using=using)
        bob = [f"bob/ch-{i:03d}" for i in range(100)]
        alice = "alice/inbox"
    else:
        bob = [f"bob-ch-{i:03d}" for i in range(100)]
        alice = "alice-inbox"
    bench.load(bob, cell.backlog)
    batch = sizes.fairness_batch
    waits: list[float] = []
    bob_taken: list[int] = []

    def claim() -> list[message_store.ClaimedMessage]:
        got = message_store.claim_messages(batch, lease=LEASE, worker_id=WORKER_ID, using=using)
        message_store.complete_messages([(m.id, m.lease_token, None) for m in got], using=using)
        return got

    for _ in range(20):  # warm-up on bob's backlog
        claim()
    for burst in range(sizes.fairness_rounds * 2):
        bench.progress.update(f"burst {burst + 1}", burst / (sizes.fairness_rounds * 2))
        enqueued = time.perf_counter()
        ids = set(
            enqueue_many(
                EnqueueRequest(NOOP_TASK_NAME, (i,), channel=alice)
                for i in range(sizes.fairness_burst)
            )
        )
        taken = 0
        deadline = enqueued + 60
        while ids:
            if time.perf_counter() > deadline:
                raise BenchmarkError("sybil: alice's burst was not served within 60 s")
            got = claim()
            now = time.perf_counter()
            for m in got:
                if m.id in ids:
                    ids.discard(m.id)
                    waits.append(1000 * (now - enqueued))
                else:
                    taken += 1
            if not got:
                time.sleep(0.001)
        bob_taken.append(taken)
        for _ in range(5):  # bob alone a moment between bursts
            claim()
    bench.reset()
    waits.sort()
    return SybilResult(
        backlog=cell.backlog,
        grouped=cell.grouped,
        samples=len(waits),
        wait_p50_ms=round(statistics.median(waits), 1),
        wait_p99_ms=round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 1),
        wait_max_ms=round(waits[-1], 1),
        bob_per_burst=round(statistics.fmean(bob_taken), 1),
        load1=round(load, 2),
    )


SYBIL = Scenario(
    name="sybil",
    title="Sybil tenant: bob's backlog in 100 channels, alice's 10 messages in one",
    plan=plan_sybil,
    run=run_sybil,
    columns=(
        Column("backlog", "backlog", ","),
        Column("grouped", "grouped"),
        Column("alice p50 ms", "wait_p50_ms", ".1f"),
        Column("alice p99 ms", "wait_p99_ms", ".1f"),
        Column("max ms", "wait_max_ms", ".1f"),
        Column("bob per burst", "bob_per_burst", ".1f"),
        Column("samples", "samples", ","),
        Column("load", "load1", ".2f"),
    ),
    summary=lambda r: f"alice p99 {r.wait_p99_ms:.1f} ms",
    key=("backlog", "grouped"),
    metric="wait_p99_ms",
    higher_is_better=False,
    notes=(
        "One claimer, claims of fairness_batch completed at once. Alice's wait: from her "
        "enqueue to the return of the claim that took the message. 'bob per burst': bob's "
        "messages claimed while her burst waited. Grouped: the tenants are channel groups "
        "alice and bob; ungrouped: 101 channels, each its own flow. Target: alice p99 <= 50 ms "
        "grouped.",
    ),
)
