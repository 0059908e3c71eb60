"""Server time inside the claim's functions, per call (``track_functions``).

Throughput and latency figures include the network round trip, the client and, for anything
that writes, the commit's WAL flush, all of which vary with the machine's mood (the same code
has measured a third apart an hour later). The time PostgreSQL spends inside each PL/pgSQL
function is much steadier, and it is what a change to the server functions (``db/functions/``)
changes: this scenario reads it from ``pg_stat_user_functions`` (with ``track_functions = 'pl'``
for its own session) as differences over ``samples`` calls.

Cells: ``empty`` (nothing to claim, nothing due, nothing to fold: the fixed cost every poll of an
idle queue pays), and ``batch 1`` / ``batch 100`` over a standing backlog in 100 channels, each
claim followed by its completion and by as many new messages to the same channels (so every
claim also folds an enqueue delta, as in steady traffic). These two cases run twice in a row,
claiming by count and then by time (``by``: the ``FAIRNESS`` modes), so the pair compares the
two modes on the same machine a moment apart. ``key-queued`` and ``key-active`` are
the backlog case with every message a unique job of that scope, refilled with new keys (the
claim writes no unique-index entry for either: a claimed message leaves the index, and scope
``active`` keeps its key through a hold row written at enqueue). Where the server runs on
this host, the backend's CPU time per claim and per completion is read from ``/proc`` too:
unlike time inside the server, it does not count waits for a core, so it is the figure to
compare on a busy machine. The WAL each claim writes is read too (the median): what the claim
writes, which the machine's CPU load does not move; checkpoints do (the first change to a page
after one writes the whole page, with ``full_page_writes`` on). Needs PostgreSQL 15+ and a role
allowed to set ``track_functions`` (a superuser, or one granted it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import timedelta

from django.db import DatabaseError

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.conf import FAIRNESS_MODES
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, backend_cpu, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import message_store

LEASE = timedelta(minutes=10)
WORKER_ID = "fairbench-functions"
CLAIM = "fairqueue_claim_v1"
PROMOTE = "fairqueue_promote_due_v1"
FOLD = "fairqueue_fold_deltas_v1"
QUIET = "fairqueue_count_quiet_v1"
COMPLETE = "fairqueue_complete_v1"


@dataclass(frozen=True)
class FunctionsCell:
    #: "empty", "backlog" (claims of ``batch`` over a standing backlog), "key-queued" or
    #: "key-active" (the same, every message a unique job of that scope)
    case: str
    batch: int
    #: the claim's fairness mode, "count" or "time" (FAIRQUEUE['FAIRNESS'])
    by: str = "count"

    @property
    def label(self) -> str:
        return f"function time  {self.case:<7}  batch {self.batch:>3}  by {self.by}"


@dataclass(frozen=True)
class FunctionsResult:
    case: str
    batch: int
    by: str
    calls: int
    #: microseconds per claim call: all of it, and its own body (without the three below)
    claim_us: float
    claim_body_us: float
    promote_us: float
    fold_us: float
    #: counting a channel's quiet enqueue deltas before taking all it counts (step 3b)
    quiet_us: float
    #: microseconds per completion call (none in the empty case)
    complete_us: float | None
    #: the server backend's CPU microseconds per claim and per completion (None: unreadable)
    claim_cpu_us: float | None
    complete_cpu_us: float | None
    #: bytes of WAL per claim call, median (what the claim writes: deterministic where the
    #: times are not; None in the empty case, which writes nothing)
    claim_wal_bytes: float | None
    load1: float


def plan(sizes: Sizes) -> list[FunctionsCell]:
    # by count and by time side by side for the idle poll and the backlog; unique jobs by count
    return [FunctionsCell("empty", 1, by) for by in FAIRNESS_MODES] + [
        cell
        for batch in sizes.functions_batches
        for cell in (
            *(FunctionsCell("backlog", batch, by) for by in FAIRNESS_MODES),
            FunctionsCell("key-queued", batch),
            FunctionsCell("key-active", batch),
        )
    ]


def per_call(
    before: dict[str, tuple[int, float, float]],
    after: dict[str, tuple[int, float, float]],
    name: str,
    calls: int,
    *,
    own: bool = False,
) -> float:
    old = before.get(name, (0, 0.0, 0.0))
    new = after.get(name)
    if new is None or new[0] - old[0] < calls:
        raise BenchmarkError(
            f"functions: pg_stat_user_functions counted {0 if new is None else new[0] - old[0]} "
            f"calls of {name}, expected at least {calls} (statistics not flushed?)"
        )
    index = 2 if own else 1
    return round(1000 * (new[index] - old[index]) / (new[0] - old[0]), 1)


def per_claim(
    before: dict[str, tuple[int, float, float]],
    after: dict[str, tuple[int, float, float]],
    name: str,
) -> float:
    """Time inside ``name`` per claim call, whether or not each claim called it (the claim
    calls the promotion and the fold only when its probe finds work for them), over the
    claims the statistics counted: with :func:`per_call`'s figure for the claim, the claim's
    own time plus these add up to its total."""
    old = before.get(name, (0, 0.0, 0.0))
    new = after.get(name, old)
    claims = after[CLAIM][0] - before.get(CLAIM, (0, 0.0, 0.0))[0]
    return round(1000 * (new[1] - old[1]) / claims, 1)


def unavailable(using: str) -> str | None:
    """Why the statistics cannot be read on ``using`` (checked before the run), or None."""
    try:
        db.enable_function_timing(using=using)
        db.force_stats_flush(using=using)
    except DatabaseError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"needs PostgreSQL 15+ and a role that may set track_functions ({first})"
    return None


def run(bench: Bench, cell: FunctionsCell) -> FunctionsResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    channels = [f"tenant-{i:03d}" for i in range(100)]
    scope = cell.case.removeprefix("key-") if cell.case.startswith("key-") else None
    if cell.case != "empty":
        bench.load(channels, sizes.functions_backlog, unique_scope=scope)
    # Again here, on the connection this cell uses (a reset may have replaced the one checked).
    reason = unavailable(using)
    if reason is not None:
        raise BenchmarkError(f"functions: {reason}")
    # The idle poll costs tens of microseconds, and the backend's CPU time is read in clock
    # ticks (10 ms): ten times the calls, so one tick is a microsecond per call, not ten.
    calls = sizes.functions_samples * 10 if cell.case == "empty" else sizes.functions_samples // 2
    # Warm-up: plans cached, statements prepared.
    for _ in range(10):
        got = message_store.claim_messages(
            cell.batch, lease=LEASE, worker_id=WORKER_ID, fairness=cell.by, using=using
        )
        message_store.release_messages([(m.id, m.lease_token) for m in got], using=using)
    cpu = backend_cpu(using)
    claim_cpu = complete_cpu = 0.0
    before = db.select_function_times(using=using)
    completions = 0
    wal: list[int] = []
    for i in range(calls):
        lsn = db.select_wal_position(using=using) if cell.case != "empty" else None
        started = cpu() if cpu is not None else 0.0
        got = message_store.claim_messages(
            cell.batch, lease=LEASE, worker_id=WORKER_ID, fairness=cell.by, using=using
        )
        claimed = cpu() if cpu is not None else 0.0
        claim_cpu += claimed - started
        if lsn is not None:
            wal.append(db.select_wal_since(lsn, using=using))
        if cell.case != "empty":
            if len(got) != cell.batch:
                raise BenchmarkError(f"functions: a claim of {cell.batch} got {len(got)}")
            message_store.complete_messages([(m.id, m.lease_token, None) for m in got], using=using)
            complete_cpu += (cpu() if cpu is not None else 0.0) - claimed
            completions += 1
            enqueue_many(
                EnqueueRequest(
                    NOOP_TASK_NAME,
                    channel=m.channel,
                    unique_key=f"k{i}-{j}" if scope else None,
                    unique_scope=scope,
                )
                for j, m in enumerate(got)
            )
        if i % 100 == 0:
            bench.progress.update(f"{i:,}/{calls:,} claims", i / calls)
    db.force_stats_flush(using=using)
    after = db.select_function_times(using=using)
    bench.reset()
    return FunctionsResult(
        case=cell.case,
        batch=cell.batch,
        by=cell.by,
        calls=calls,
        claim_us=per_call(before, after, CLAIM, calls),
        claim_body_us=per_call(before, after, CLAIM, calls, own=True),
        promote_us=per_claim(before, after, PROMOTE),
        fold_us=per_claim(before, after, FOLD),
        quiet_us=per_claim(before, after, QUIET),
        complete_us=per_call(before, after, COMPLETE, completions) if completions else None,
        claim_cpu_us=round(1e6 * claim_cpu / calls) if cpu is not None else None,
        complete_cpu_us=(
            round(1e6 * complete_cpu / completions) if cpu is not None and completions else None
        ),
        claim_wal_bytes=statistics.median(wal) if wal else None,
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="functions",
    title="Server time inside the claim's functions (microseconds per call)",
    plan=plan,
    run=run,
    columns=(
        Column("case", "case"),
        Column("batch", "batch"),
        Column("by", "by"),
        Column("claim µs", "claim_us", ".1f"),
        Column("its body", "claim_body_us", ".1f"),
        Column("promote", "promote_us", ".1f"),
        Column("fold", "fold_us", ".1f"),
        Column("quiet", "quiet_us", ".1f"),
        Column("complete µs", "complete_us", ".1f"),
        Column("claim CPU µs", "claim_cpu_us", ".0f"),
        Column("complete CPU µs", "complete_cpu_us", ".0f"),
        Column("claim WAL B", "claim_wal_bytes", ",.0f"),
        Column("calls", "calls", ","),
    ),
    summary=lambda r: f"claim {r.claim_us:.1f} µs",
    key=("case", "batch", "by"),
    metric="claim_us",
    higher_is_better=False,
    unavailable=unavailable,
    notes=(
        "Time inside PL/pgSQL functions as pg_stat_user_functions counts it (track_functions = "
        "'pl'), per call: no round trip, no client, no commit. claim µs includes promote, "
        "fold and quiet (their time per claim: a claim calls them only when there is work for "
        "them; quiet counts the quiet enqueue deltas of a channel whose room is all it counts); "
        "its body is the rest.",
        "empty: nothing to claim, promote or fold (an idle queue's poll). backlog: claims over "
        "100 channels, each completed and its messages enqueued again, untimed. key-queued, "
        "key-active: the same with every message a unique job of that scope.",
        "by: the claim's fairness mode (FAIRQUEUE['FAIRNESS']); the idle poll and the backlog "
        "run by count and then by time, a moment apart, to compare the two.",
        "CPU µs: the server backend's CPU time per call, from /proc (where the server runs on "
        "this host): it leaves out waits for a core, so it is the figure to compare on a busy "
        "machine.",
        "claim WAL B: bytes of WAL one claim writes (median; read before and after each claim, "
        "outside the timed window): CPU load does not move it, checkpoints do (the first change "
        "to a page after one writes the whole page: full_page_writes), so a server that "
        "checkpoints often reads higher.",
    ),
)
