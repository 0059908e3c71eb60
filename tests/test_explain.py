"""Prove the plans: the claim and the settle statements touch indexes and a handful of rows,
never the backlog, at 100,000 queued messages over 1,000 channels.

EXPLAIN of ``SELECT * FROM fairqueue_claim_v1(...)`` shows only a Function Scan: the statements
that matter run inside the function. auto_explain logs the real plan of every statement,
nested ones included, with actual row counts; at ``log_level = notice`` PostgreSQL sends each
plan to the client as a NOTICE, which a psycopg notice handler collects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection

from django_fairqueue.db import message_store
from django_fairqueue.models import ChannelDelta
from tests import factories as f

# The backlog is loaded and committed once for the module; each test runs in a transaction
# that is rolled back, so every test starts from the same 100,000 ready messages.
pytestmark = pytest.mark.django_db

QUEUE_TABLES = {"fairqueue_message", "fairqueue_channel"}
#: With channel groups, the group table too (without groups it is empty, and the one probe of
#: it a claim makes may be a sequential scan of nothing)
GROUPED_TABLES = QUEUE_TABLES | {"fairqueue_channel_group"}
LIMIT = 100
LEASE = timedelta(minutes=5)


@dataclass
class Plan:
    query: str
    root: dict[str, Any]

    def nodes(self) -> Iterator[dict[str, Any]]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.get("Plans", ()))

    def describe(self) -> str:
        lines = [self.query.strip().splitlines()[0][:100]]
        for node in self.nodes():
            lines.append(
                f"  {node['Node Type']} {node.get('Relation Name', '')} "
                f"{node.get('Index Name', '')} rows={node.get('Actual Rows')} "
                f"loops={node.get('Actual Loops')}"
            )
        return "\n".join(lines)


@dataclass
class AutoExplain:
    """Collects the plans auto_explain sends while ``capture()`` is active."""

    plans: list[Plan] = field(default_factory=list)

    def on_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        message = diag.message_primary or ""
        if "plan:" in message:
            data = json.loads(message[message.index("{") :])
            self.plans.append(Plan(data["Query Text"], data["Plan"]))

    def take(self) -> list[Plan]:
        plans, self.plans = self.plans, []
        return plans


def start_auto_explain() -> AutoExplain:
    """From now on, collect the plan of every statement this connection's session runs."""
    collector = AutoExplain()
    with connection.cursor() as cur:
        try:
            cur.execute("LOAD 'auto_explain'")
        except Exception as exc:  # e.g. not a superuser on a DATABASE_URL server
            pytest.skip(f"auto_explain unavailable: {exc}")
    connection.connection.add_notice_handler(collector.on_notice)
    with connection.cursor() as cur:
        for setting in (
            "auto_explain.log_min_duration = 0",
            "auto_explain.log_nested_statements = on",
            "auto_explain.log_analyze = on",
            "auto_explain.log_buffers = off",
            "auto_explain.log_timing = off",
            "auto_explain.log_format = json",
            "auto_explain.log_level = notice",
            "client_min_messages = notice",
        ):
            cur.execute(f"SET {setting}")
    collector.take()
    return collector


@pytest.fixture
def auto_explain() -> Iterator[AutoExplain]:
    collector = start_auto_explain()
    try:
        yield collector
    finally:
        # the SETs roll back with the test's transaction; auto_explain then logs nothing
        connection.connection.remove_notice_handler(collector.on_notice)


def touched(node: dict[str, Any]) -> float:
    """Rows a node read over all its loops, including those its filters threw away."""
    per_loop = (
        node.get("Actual Rows", 0)
        + node.get("Rows Removed by Filter", 0)
        + node.get("Rows Removed by Index Recheck", 0)
    )
    return float(per_loop * node.get("Actual Loops", 1))


def assert_small_and_indexed(
    plans: list[Plan], *, budget: int, tables: set[str] = QUEUE_TABLES
) -> set[str]:
    """No sequential scan of a queue table, no node on one that reads more than ``budget`` rows.
    Returns the indexes used."""
    assert plans, "auto_explain reported no plans"
    indexes = set()
    problems = []
    for plan in plans:
        for node in plan.nodes():
            relation = node.get("Relation Name")
            if "Index Name" in node:
                indexes.add(node["Index Name"])
            if relation not in tables:
                continue
            if "Seq Scan" in node["Node Type"]:
                problems.append(f"sequential scan of {relation}:\n{plan.describe()}")
            elif touched(node) > budget:
                problems.append(
                    f"{node['Node Type']} on {relation} read {touched(node):.0f} rows "
                    f"(budget {budget}):\n{plan.describe()}"
                )
    assert not problems, "\n".join(problems)
    return indexes


@pytest.fixture(scope="module")
def backlog(django_db_setup: None, django_db_blocker: Any) -> Iterator[list[int]]:
    """100,000 ready messages over 1,000 channels and 1,000 delayed ones, committed, with
    fresh statistics; removed when the module is done."""
    with django_db_blocker.unblock():
        channel_ids = f.bulk_load_ready(1_000, 100)
        f.enqueue("delayed", 1_000, run_after=timedelta(hours=1))
        f.fold_all()
        f.measured()  # tenants that have run before (by time, not slow-starting)
        analyze()
    yield channel_ids
    with django_db_blocker.unblock(), connection.cursor() as cur:
        cur.execute(
            "TRUNCATE fairqueue_message, fairqueue_channel, fairqueue_channel_delta, "
            "fairqueue_channel_group"
        )


def analyze() -> None:
    with connection.cursor() as cur:
        cur.execute("ANALYZE fairqueue_message, fairqueue_channel, fairqueue_channel_delta")


def claim(fairness: str = "count") -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(LIMIT, lease=LEASE, worker_id="explain", fairness=fairness)


@pytest.mark.parametrize("fairness", ["count", "time"])
@pytest.mark.parametrize("plan_cache_mode", ["auto", "force_custom_plan", "force_generic_plan"])
def test_claim_reads_indexes_and_a_few_rows_per_call(
    backlog: list[int], auto_explain: AutoExplain, plan_cache_mode: str, fairness: str
) -> None:
    with connection.cursor() as cur:
        cur.execute("SET plan_cache_mode = %s", [plan_cache_mode])

    # Several calls: PL/pgSQL plans its statements with the first calls' values, then may
    # switch to a generic plan from the sixth call on. Every call's plans are checked.
    # By time the walk is on the tag index instead of the turn index.
    walk = "fq_channel_turn_idx" if fairness == "count" else "fq_channel_vtime_idx"
    for call in range(8):
        got = claim(fairness)
        assert len(got) == LIMIT
        plans = auto_explain.take()
        indexes = assert_small_and_indexed(plans, budget=10 * LIMIT)
        # The promotion's probe for due scheduled messages may read either partial index of
        # scheduled rows: with none scheduled both cost the same, and which one the planner
        # takes depends on statistics earlier tests left (seen: the channel one in one run).
        scheduled = {"fq_message_due_idx", "fq_message_sched_chan_idx"}
        assert {walk, "fq_message_ready_idx"} <= indexes and scheduled & indexes, (
            f"call {call}: indexes used {sorted(indexes)}\n"
            + "\n".join(p.describe() for p in plans)
        )
        # the batch spread over about 25 channels, not over the backlog of one
        assert len({m.channel_id for m in got}) >= 20


@pytest.mark.parametrize("fairness", ["count", "time"])
@pytest.mark.parametrize("groups", [1, 100])
def test_grouped_claim_reads_indexes_and_a_few_rows_per_call(
    backlog: list[int], auto_explain: AutoExplain, fairness: str, groups: int
) -> None:
    # The 1,000 channels spread over `groups` channel groups (the trigger moves their sums),
    # and one ungrouped channel beside them: the claim walks groups and ungrouped channels
    # merged, then each group's channels, on indexes only.
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO fairqueue_channel_group (name, weight, release_interval, created_at) "
            "SELECT 'g' || i, 1, interval '0', now() FROM generate_series(0, %s - 1) AS i",
            [groups],
        )
        cur.execute(
            "UPDATE fairqueue_channel c SET group_id = g.id FROM fairqueue_channel_group g "
            "WHERE starts_with(c.name, 'bulk-') AND g.name = 'g' || (c.id %% %s)",
            [groups],
        )
        cur.execute("ANALYZE fairqueue_channel_group")
    f.enqueue("solo", 50)
    f.fold_all()
    f.measured()
    analyze()
    auto_explain.take()
    walk = {"count": "fq_group_turn_idx", "time": "fq_group_vtime_idx"}[fairness]
    inner = {"count": "fq_channel_in_group_turn_idx", "time": "fq_channel_in_group_vtime_idx"}
    for call in range(8):
        got = claim(fairness)
        assert len(got) == LIMIT
        plans = auto_explain.take()
        indexes = assert_small_and_indexed(plans, budget=10 * LIMIT, tables=GROUPED_TABLES)
        assert {walk, inner[fairness], "fq_message_ready_idx"} <= indexes, (
            f"call {call}: indexes used {sorted(indexes)}\n"
            + "\n".join(p.describe() for p in plans)
        )


@pytest.mark.parametrize("fairness", ["count", "time"])
def test_claim_folds_pending_deltas_without_scanning_the_channels(
    backlog: list[int], auto_explain: AutoExplain, fairness: str
) -> None:
    # By time the fold also reads the system's virtual time: two index probes.
    f.enqueue_spread({f"bulk-{i:05d}": 1 for i in range(0, 1_000, 10)})  # 100 waking deltas
    analyze()
    auto_explain.take()

    claim(fairness)

    assert_small_and_indexed(auto_explain.take(), budget=10 * LIMIT)


@pytest.mark.parametrize("fairness", ["count", "time"])
def test_a_fold_into_channels_claimable_already_writes_no_index_entry(
    backlog: list[int], fairness: str
) -> None:
    # Steady traffic: new messages for channels with a backlog. Their fold moves counters and
    # no indexed column (the walk indexes read `claimable`, which stays true), so PostgreSQL
    # rewrites each row within its page (HOT): no entry in any of the channel's indexes, no
    # uniqueness check of its name. Counted by this transaction's own statistics.
    f.enqueue_spread({f"bulk-{i:05d}": 1 for i in range(0, 1_000, 10)})  # 100 waking deltas

    def updates() -> tuple[int, int]:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
                "WHERE relname = 'fairqueue_channel'"
            )
            (row,) = cur.fetchall()
        return row

    before = updates()
    with connection.cursor() as cur:
        cur.execute("SELECT fairqueue_fold_deltas_v1(1000, false, %s)", [fairness == "time"])
        assert cur.fetchone() == (100,)
    after = updates()
    assert (after[0] - before[0], after[1] - before[1]) == (100, 100)


def test_the_admins_state_index_leaves_running_messages_out(backlog: list[int]) -> None:
    # A claim's ready -> running is never a HOT update (the state is indexed), so each index
    # that keeps an entry for a running row costs the claim one entry per message taken. The
    # admin's state index has none for them: its state filter finds the running few through
    # the lease index, and an old state's messages without walking the newer ones.
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_get_expr(indpred, indrelid) FROM pg_index "
            "WHERE indexrelid = 'fq_message_state_idx'::regclass"
        )
        (predicate,) = cur.fetchone()
    assert predicate is not None and "'running'" in predicate

    def page(state: str) -> tuple[list[int], set[str]]:
        query = "SELECT id FROM fairqueue_message WHERE state = %s ORDER BY id DESC LIMIT 101"
        with connection.cursor() as cur:
            cur.execute(query, [state])
            ids = [row[0] for row in cur.fetchall()]
            cur.execute("EXPLAIN (FORMAT JSON) " + query, [state])
            (doc,) = cur.fetchone()
        plan = Plan(query, (json.loads(doc) if isinstance(doc, str) else doc)[0]["Plan"])
        return ids, {n["Index Name"] for n in plan.nodes() if "Index Name" in n}

    got = claim()
    with connection.cursor() as cur:  # the oldest messages, behind 100,000 newer ones
        cur.execute(
            "SELECT id FROM fairqueue_message WHERE state = %s ORDER BY id LIMIT 50", ["ready"]
        )
        oldest = [row[0] for row in cur.fetchall()]
    message_store.cancel_messages(oldest)
    analyze()
    running, running_indexes = page("running")
    assert running == sorted((m.id for m in got), reverse=True)
    assert running_indexes == {"fq_message_lease_idx"}
    cancelled, cancelled_indexes = page("cancelled")
    assert cancelled == sorted(oldest, reverse=True)
    # (the state index, or the partial index of finished rows and a sort of the few)
    assert "fairqueue_message_pkey" not in cancelled_indexes


def test_the_claims_fold_reads_only_the_deltas_it_folds(
    backlog: list[int], auto_explain: AutoExplain
) -> None:
    # Completions on uncapped channels leave non-waking deltas for maintenance to fold in bulk
    # (it runs every few seconds; a busy channel gathers thousands meanwhile). The claim folds
    # only the waking ones, and must find them without reading the others: a generic plan once
    # deleted by the channel index and filtered by id, reading every delta of the channel.
    names = [f"bulk-{i:05d}" for i in range(10)]
    ids = f.channel_ids(names)
    ChannelDelta.objects.bulk_create(
        ChannelDelta(channel_id=ids[name], succeeded=1, wake=False)
        for name in names
        for _ in range(500)
    )
    f.enqueue_spread(dict.fromkeys(names, 1))  # 10 waking deltas on the same channels
    # No ANALYZE: statistics taken when the delta table was nearly empty, as they mostly are
    # (maintenance empties it every few seconds), rate both indexes alike.
    for _ in range(8):  # past PL/pgSQL's switch to a generic plan
        with connection.cursor() as cur:
            cur.execute("SAVEPOINT fold")
            auto_explain.take()
            claim()
            plans = auto_explain.take()
            cur.execute("ROLLBACK TO SAVEPOINT fold")
        read = {
            (node["Node Type"], node.get("Index Name")): touched(node)
            for plan in plans
            for node in plan.nodes()
            if node.get("Relation Name") == "fairqueue_channel_delta"
        }
        assert read and max(read.values()) <= 50, read


def test_a_claim_that_may_wait_finds_nothing_to_wait_for_from_the_index(
    backlog: list[int], auto_explain: AutoExplain
) -> None:
    # Every channel has ready work but is rate limited, its next release an hour away: nothing
    # is claimable and no claim holds anything. A claim allowed to wait (CLAIM_WAIT) looks for
    # a held channel to queue for; it must learn there is none from the index, not by reading
    # all 1,000 channels and filtering them.
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET release_interval = interval '1 hour', "
            "next_turn_at = clock_timestamp() + interval '1 hour'"
        )
    auto_explain.take()
    params = {"limit": LIMIT, "lease": LEASE, "worker": "explain", "only": None}
    params |= {"exclude": None, "quantum": None, "maintain": True, "wait_ms": 50, "by_time": False}
    params["queues"] = ["default"]  # (all queues: the same, after a probe per queue)
    params["async_except"] = None

    assert (
        message_store.queries.run("claim_messages", params) == []
    )  # (the test's transaction: no retry)

    plans = auto_explain.take()
    turn_scans = [
        node
        for plan in plans
        for node in plan.nodes()
        # (run: the housekeeping's statement plans the probes of every queue as subqueries it
        # runs only when claiming every queue)
        if node.get("Index Name") == "fq_channel_turn_idx" and node.get("Actual Loops")
    ]
    # the walk, the wait, and the walk once more after it (a concurrent fold may have committed)
    assert len(turn_scans) == 3, "expected the walk, the wait and the last walk on the index"
    assert_small_and_indexed(plans, budget=LIMIT)


@pytest.mark.parametrize("fairness", ["count", "time"])
@pytest.mark.parametrize("grouped", [False, True])
def test_a_claim_of_one_queue_reads_nothing_of_another(
    backlog: list[int], auto_explain: AutoExplain, fairness: str, grouped: bool
) -> None:
    # 1,000 backlogged channels in the default queue, one channel (of a group, or not) in
    # queue "a". A worker of queue "a" walks queue a's index entries only: the channel rows it
    # reads are its own channel's, however many other queues' channels are claimable.
    channel = ("t", "one") if grouped else "one"
    f.enqueue_in_queue("a", channel, 5)
    f.fold_all()
    f.measured()
    auto_explain.take()
    for _ in range(8):  # past PL/pgSQL's switch to a generic plan
        with connection.cursor() as cur:
            cur.execute("SAVEPOINT q")
        got = message_store.claim_messages(
            LIMIT, lease=LEASE, worker_id="explain", fairness=fairness, queues=["a"]
        )
        assert len(got) == 5 and {m.queue for m in got} == {"a"}
        plans = auto_explain.take()
        with connection.cursor() as cur:
            cur.execute("ROLLBACK TO SAVEPOINT q")
        # channel and group rows read: a handful, not the 1,000 claimable in "default"
        assert_small_and_indexed(plans, budget=10, tables=GROUPED_TABLES - {"fairqueue_message"})
        assert_small_and_indexed(plans, budget=10 * LIMIT, tables=GROUPED_TABLES)


@pytest.mark.parametrize("fairness", ["count", "time"])
def test_a_claim_of_every_queue_finds_the_queues_from_the_indexes(
    backlog: list[int], auto_explain: AutoExplain, fairness: str
) -> None:
    # Two queues with work: a claim of all queues finds them by skipping through the turn
    # indexes (a probe per queue), then serves them in turn, the queue whose first channel
    # has waited longest first (here "a"'s): nothing reads the backlog.
    f.enqueue_in_queue("a", "one", 5)
    f.fold_all()
    f.measured()
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET next_turn_at = now() - interval '1 day' WHERE queue = 'a'"
        )
    auto_explain.take()
    got = message_store.claim_messages(LIMIT, lease=LEASE, worker_id="explain", fairness=fairness)
    assert len(got) == LIMIT
    assert [m.queue for m in got[:5]] == ["a"] * 5 and {m.queue for m in got[5:]} == {"default"}
    assert_small_and_indexed(auto_explain.take(), budget=10 * LIMIT, tables=GROUPED_TABLES)


def settle_plans(auto_explain: AutoExplain, run: Callable[[], object]) -> list[Plan]:
    """Plans of ``run()``, twice with custom plans and twice with the generic plan a prepared
    statement may switch to; the second run of each finds its tokens settled (or renewed)."""
    plans = []
    for mode in ("force_custom_plan", "force_generic_plan"):
        with connection.cursor() as cur:
            cur.execute("SET plan_cache_mode = %s", [mode])
        for _ in range(2):
            run()
            plans += auto_explain.take()
    return plans


@pytest.fixture
def in_flight(backlog: list[int], auto_explain: AutoExplain) -> list[message_store.ClaimedMessage]:
    running = [m for _ in range(30) for m in claim()]  # 3,000 running
    auto_explain.take()
    return running


@pytest.mark.parametrize(
    "statement", ["complete", "heartbeat", "release", "abort", "settle_aborted"]
)
def test_settle_statements_read_primary_keys_only(
    in_flight: list[message_store.ClaimedMessage], auto_explain: AutoExplain, statement: str
) -> None:
    batch = in_flight[:LIMIT]
    leases = [(m.id, m.lease_token) for m in batch]
    run = {
        "complete": lambda: message_store.complete_messages([(*lease, 1) for lease in leases]),
        "heartbeat": lambda: message_store.heartbeat_messages(leases, lease=LEASE),
        "release": lambda: message_store.release_messages(leases),
        "abort": lambda: message_store.abort_messages([m.id for m in batch]),
        "settle_aborted": lambda: message_store.settle_aborted_messages(
            [(*lease, {"type": "TaskAborted"}) for lease in leases]
        ),
    }[statement]

    plans = settle_plans(auto_explain, run)

    indexes = assert_small_and_indexed(plans, budget=3 * LIMIT)
    assert "fairqueue_message_pkey" in indexes, "\n".join(p.describe() for p in plans)


def test_fail_reads_primary_keys_only(
    in_flight: list[message_store.ClaimedMessage], auto_explain: AutoExplain
) -> None:
    error = {"type": "RuntimeError", "message": "boom", "traceback": None}
    failed = [(m.id, m.lease_token, error, timedelta(minutes=1)) for m in in_flight[:LIMIT]]

    plans = settle_plans(auto_explain, lambda: message_store.fail_messages(failed))

    indexes = assert_small_and_indexed(plans, budget=3 * LIMIT)
    assert "fairqueue_message_pkey" in indexes


def test_a_returning_unique_job_looks_for_a_newer_holder_in_the_unique_index(
    backlog: list[int], auto_explain: AutoExplain
) -> None:
    """A unique job (scope queued) failing with a retry checks whether a newer message took its
    key: one probe of fq_message_unique_idx per keyed row, on top of primary-key lookups."""
    from django_fairqueue.api import EnqueueRequest, enqueue_many

    keyed = enqueue_many(
        [
            EnqueueRequest("tests.fair.add", (1, 1), channel="keyed", unique_key=f"k{i}")
            for i in range(LIMIT)
        ]
    )
    f.fold_all()
    got = message_store.claim_messages(
        LIMIT,
        lease=LEASE,
        worker_id="explain",
        only_channel_ids=[f.channel_ids(["keyed"])["keyed"]],
    )
    assert {m.id for m in got} == set(keyed)
    enqueue_many(  # newer holders of half the keys
        [
            EnqueueRequest("tests.fair.add", (2, 2), channel="keyed", unique_key=f"k{i}")
            for i in range(0, LIMIT, 2)
        ]
    )
    auto_explain.take()
    error = {"type": "RuntimeError", "message": "boom", "traceback": None}
    states = message_store.fail_messages([(m.id, m.lease_token, error, timedelta(0)) for m in got])
    plans = auto_explain.take()
    assert sorted(states.values()).count("cancelled") == LIMIT // 2
    indexes = assert_small_and_indexed(plans, budget=3 * LIMIT)
    assert {"fairqueue_message_pkey", "fq_message_unique_idx"} <= indexes, "\n".join(
        p.describe() for p in plans
    )
