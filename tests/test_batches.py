"""Work batches: planning over sparse ids, fair claims under caps, leases, fencing, progress."""

from __future__ import annotations

import inspect
import itertools
import re
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_fairqueue import batches, conf
from django_fairqueue.exceptions import InvalidChannel, LeaseLost
from django_fairqueue.models import BatchState, Channel, WorkBatch


def batch_pending(name: str) -> bool:
    """The channel's batch_pending flag, its pending deltas folded first (read with SQL: the
    scheduler's columns are no model fields)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT fairqueue_fold_channel_v1(id) FROM fairqueue_channel WHERE name = %s", [name]
        )
        cur.execute("SELECT batch_pending FROM fairqueue_channel WHERE name = %s", [name])
        return bool(cur.fetchone()[0])


SOURCE = "fq_test_source"
LEASE = timedelta(seconds=30)


def make_source(ids: list[int], *, tenant_of: Any = None) -> None:
    """A source table with these ids (and a tenant column), indexed like a real one."""
    with connection.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {SOURCE}")
        cur.execute(
            f"CREATE TABLE {SOURCE} (id bigint PRIMARY KEY, tenant integer NOT NULL, "
            "label text NOT NULL DEFAULT '')"
        )
        cur.execute(f"CREATE INDEX ON {SOURCE} (tenant, id)")
        tenants = [tenant_of(i) if tenant_of else 1 for i in ids]
        cur.execute(
            f"INSERT INTO {SOURCE} (id, tenant) SELECT * FROM unnest(%s::bigint[], %s::int[])",
            [ids, tenants],
        )


def expire(batch: batches.ClaimedBatch) -> None:
    """Let the batch's lease run out now (a claim takes no lease shorter than the minimum)."""
    WorkBatch.objects.filter(pk=batch.id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def drop_source() -> None:
    with connection.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {SOURCE}")


def job_batches(job: str) -> list[WorkBatch]:
    return list(WorkBatch.objects.filter(job_name=job).order_by("start_id"))


def ids_in(lo: int, hi: int) -> int:
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {SOURCE} WHERE id BETWEEN %s AND %s", [lo, hi])
        return int(cur.fetchone()[0])


# ---------------------------------------------------------------------------------------------
# Planning


@pytest.mark.django_db
def test_plan_sparse_ids_gives_full_contiguous_batches() -> None:
    # ids with big holes: 1..500, then every 1000th up to 1,000,000, then a dense tail
    ids = (
        list(range(1, 501))
        + list(range(10_000, 1_000_001, 1000))
        + list(range(2_000_000, 2_000_250))
    )
    make_source(ids)
    seen: list[tuple[int, float]] = []
    result = batches.plan(
        "sparse",
        channel="alice",
        table=SOURCE,
        batch_size=100,
        progress=lambda r, f: seen.append((r, f)),
    )
    planned = job_batches("sparse")
    assert result.created == len(planned) == -(-len(ids) // 100)
    assert result.rows_planned == len(ids) == sum(b.row_count for b in planned)
    assert all(b.row_count == 100 for b in planned[:-1])
    assert planned[0].start_id == 1 and planned[-1].end_id == ids[-1]
    for before, after in itertools.pairwise(planned):
        assert after.start_id == before.end_id + 1  # contiguous: no id can fall between
    for b in planned:
        assert ids_in(b.start_id, b.end_id) == b.row_count
        assert b.state == BatchState.PENDING and b.lease_token is None
    assert seen and seen[-1] == (len(ids), 1.0)
    assert [f for _, f in seen] == sorted(f for _, f in seen)


@pytest.mark.django_db
def test_plan_twice_adds_nothing_and_appended_rows_get_new_batches() -> None:
    make_source(list(range(1, 1001)))
    first = batches.plan("again", channel="alice", table=SOURCE, batch_size=300)
    assert (first.created, first.batches_total) == (4, 4)
    second = batches.plan("again", channel="alice", table=SOURCE, batch_size=300)
    assert (second.created, second.batches_total, second.rows_planned) == (0, 4, 0)
    with connection.cursor() as cur:
        cur.execute(
            f"INSERT INTO {SOURCE} (id, tenant) SELECT g, 1 FROM generate_series(1001, 1450) g"
        )
    third = batches.plan("again", channel="alice", table=SOURCE, batch_size=300)
    assert (third.created, third.rows_planned) == (2, 450)
    planned = job_batches("again")
    assert planned[4].start_id == 1001 and planned[-1].end_id == 1450
    assert sum(b.row_count for b in planned) == 1450


@pytest.mark.django_db
def test_plan_with_filters_covers_only_the_tenants_rows() -> None:
    make_source(list(range(1, 2001)), tenant_of=lambda i: 1 + i % 2)
    result = batches.plan("t2", channel="bob", table=SOURCE, batch_size=250, filters={"tenant": 2})
    assert result.rows_planned == 1000 and result.created == 4
    assert all(b.row_count == 250 for b in job_batches("t2"))


@pytest.mark.django_db
def test_plan_from_a_model_uses_its_table_and_primary_key() -> None:
    Channel.objects.bulk_create([Channel(name=f"c{i}") for i in range(12)])
    result = batches.plan("from-model", channel="alice", table=Channel, batch_size=5)
    assert result.rows_planned == Channel.objects.count()


@pytest.mark.django_db
def test_plan_rejects_bad_input_clearly() -> None:
    make_source([1, 2, 3])
    with pytest.raises(ValueError, match="no column 'id' in table 'nope'"):
        batches.plan("x", channel="a", table="nope")
    with pytest.raises(ValueError, match="no column 'nope'"):
        batches.plan("x", channel="a", table=SOURCE, id_column="nope")
    with pytest.raises(ValueError, match="label is text; work batches need an integer id"):
        batches.plan("x", channel="a", table=SOURCE, id_column="label")
    with pytest.raises(ValueError, match="filter column 'tenant_id'"):
        batches.plan("x", channel="a", table=SOURCE, filters={"tenant_id": 1})
    with pytest.raises(ValueError, match="batch_size must be 1 to"):
        batches.plan("x", channel="a", table=SOURCE, batch_size=0)
    with pytest.raises(ValueError, match="job name"):
        batches.plan(" x", channel="a", table=SOURCE)
    with pytest.raises(InvalidChannel):
        batches.plan("x", channel="", table=SOURCE)
    with pytest.raises(TypeError, match="model or a table name"):
        batches.plan("x", channel="a", table=42)  # type: ignore[arg-type]
    # a hostile table name is an identifier that does not exist, never SQL
    with pytest.raises(ValueError, match="no such table"):
        batches.plan("x", channel="a", table='fq_test_source"; DROP TABLE fq_test_source; --')
    assert ids_in(1, 3) == 3
    batches.plan("x", channel="a", table=SOURCE)
    with pytest.raises(ValueError, match="planned on channel 'a', not 'b'"):
        batches.plan("x", channel="b", table=SOURCE)
    assert not WorkBatch.objects.filter(job_name="x").exclude(channel__name="a").exists()


@pytest.mark.django_db
def test_bad_filters_and_ranges_are_refused_naming_the_argument_and_write_nothing() -> None:
    make_source([1, 2, 3])
    with transaction.atomic():  # the caller's transaction stays usable after each refusal
        with pytest.raises(ValueError, match=r"filters \{'tenant': 'abc'\} do not fit .*integer"):
            batches.plan("bad", channel="bad", table=SOURCE, filters={"tenant": "abc"})
        shape = r"must be \(first id, last id, rows\), got"
        refused: list[tuple[Any, type[Exception], str]] = [
            ([(True, 10, 1)], TypeError, r"ranges\[0\]: the first id must be an integer"),
            ([(1, 2**70, 1)], ValueError, rf"ranges\[0\]: the last id must be .* got {2**70}"),
            ([(1, 10, 1), (20, 30, -1)], ValueError, r"ranges\[1\]: the rows must be 0 to"),
            ([(1, 10)], TypeError, rf"ranges\[0\] {shape} \(1, 10\)"),
            ([5], TypeError, rf"ranges\[0\] {shape} 5"),
            (7, TypeError, "ranges must be a list of"),
        ]
        for ranges, error, message in refused:
            with pytest.raises(error, match=message):
                batches.plan_ranges("bad", channel="bad", ranges=ranges)
        with pytest.raises(ValueError, match="max_attempts must be 1 to 2147483647"):
            batches.plan_ranges("bad", channel="bad", ranges=[(1, 2, 1)], max_attempts=2**40)
        with pytest.raises(ValueError, match="batch_size must be 1 to 9223372036854775807"):
            batches.plan("bad", channel="bad", table=SOURCE, batch_size=2**70)
        assert not Channel.objects.filter(name="bad").exists()
        assert not WorkBatch.objects.filter(job_name="bad").exists()
        # the right values plan
        assert batches.plan("bad", channel="bad", table=SOURCE, filters={"tenant": 1}).created == 1


@pytest.mark.django_db
def test_bad_ids_and_limits_are_refused_before_anything_runs() -> None:
    """A wrong type or a value PostgreSQL cannot hold is a TypeError or ValueError naming the
    argument, never a DataError from the server."""
    refused: list[tuple[Any, type[Exception], str]] = [
        (lambda: batches.delete_failed(["x"]), TypeError, "a batch id must be an integer"),
        (lambda: batches.delete_failed([0]), ValueError, "a batch id must be 1 to 9223"),
        (lambda: batches.delete_failed([2**63]), ValueError, "a batch id must be 1 to 9223"),
        (lambda: batches.delete_failed(7), TypeError, "ids must be a list of batch ids"),
        (lambda: batches.retry_failed(ids=["x"]), TypeError, "a batch id must be an integer"),
        (lambda: batches.retry_failed(ids="12"), TypeError, "ids must be a list of batch ids"),
        (lambda: batches.rescue_expired(limit=-1), ValueError, "limit must be 1 to 2147483647"),
        (lambda: batches.rescue_expired(limit=2**40), ValueError, "limit must be 1 to"),
        (lambda: batches.rescue_expired(limit=1.5), TypeError, "limit must be an integer"),
    ]
    with transaction.atomic():  # the caller's transaction stays usable after each refusal
        for call, error, message in refused:
            with pytest.raises(error, match=message):
                call()
        assert batches.delete_failed([]) == []
        assert batches.retry_failed(ids=[1]) == []
        assert batches.rescue_expired(limit=1) == []


# ---------------------------------------------------------------------------------------------
# Claiming


def plan_job(job: str, channel: str, n_batches: int, size: int = 10) -> None:
    """A job of n_batches batches of `size` rows, over a shared id space (the plan only counts)."""
    make_source_if_needed(n_batches * size)
    batches.plan(job, channel=channel, table=SOURCE, batch_size=size)
    extra = WorkBatch.objects.filter(job_name=job).order_by("start_id")[n_batches:]
    WorkBatch.objects.filter(pk__in=[b.pk for b in extra]).delete()


def make_source_if_needed(rows: int) -> None:
    with connection.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", [SOURCE])
        exists = cur.fetchone()[0]
        have = 0
        if exists:
            cur.execute(f"SELECT count(*) FROM {SOURCE}")
            have = cur.fetchone()[0]
    if have < rows:
        make_source(list(range(1, rows + 1)))


@pytest.mark.django_db
def test_claims_rotate_across_channels_and_a_small_tenant_is_served_at_once() -> None:
    plan_job("big", "alice", 200)
    batches.claim(worker_id="w", lease=LEASE)  # alice starts first
    plan_job("small", "bob", 3)
    claimed = [batches.claim(worker_id="w", lease=LEASE) for _ in range(8)]
    channels = [b.channel for b in claimed if b is not None]
    # a new channel joins the back of the line: bob waits for one batch of each active
    # channel (here alice's), then the two alternate until bob's three are out
    assert channels[:7] == ["alice", "bob", "alice", "bob", "alice", "bob", "alice"]
    assert all(b is not None and b.attempts == 1 and b.lease_token for b in claimed)
    assert len({b.id for b in claimed if b}) == 8


@pytest.mark.django_db
def test_weight_gives_consecutive_turns() -> None:
    plan_job("heavy", "heavy", 60)
    plan_job("light", "light", 60)
    Channel.objects.filter(name="heavy").update(weight=3)
    served = Counter(
        b.channel for b in (batches.claim(worker_id="w", lease=LEASE) for _ in range(40)) if b
    )
    assert served["heavy"] == 30 and served["light"] == 10


@pytest.mark.django_db
def test_cap_paused_job_filter_and_run_at() -> None:
    plan_job("capped", "capped", 10)
    plan_job("other:1", "other", 10)
    Channel.objects.filter(name="capped").update(max_concurrency=2)
    only_capped = ["capped"]
    a = batches.claim(worker_id="w", lease=LEASE, channels=only_capped)
    b = batches.claim(worker_id="w", lease=LEASE, channels=only_capped)
    assert a and b and batches.claim(worker_id="w", lease=LEASE, channels=only_capped) is None
    with batches.fenced(a) as fence:
        fence.rows_processed = 10
    c = batches.claim(worker_id="w", lease=LEASE, channels=only_capped)
    assert c is not None and c.channel == "capped"
    # job filters: exact names and prefixes
    assert batches.claim(worker_id="w", lease=LEASE, jobs=["nope"]) is None
    d = batches.claim(worker_id="w", lease=LEASE, jobs=["other:*"])
    assert d is not None and d.job_name == "other:1"
    # paused channels wait; excluded channels are skipped
    Channel.objects.filter(name="other").update(paused=True)
    assert batches.claim(worker_id="w", lease=LEASE, jobs=["other:*"]) is None
    Channel.objects.filter(name="other").update(paused=False)
    assert batches.claim(worker_id="w", lease=LEASE, exclude_channels=["other", "capped"]) is None
    # a batch waits for its run_at
    WorkBatch.objects.filter(job_name="other:1", state="pending").update(
        run_at=timezone.now() + timedelta(days=1)
    )
    assert batches.claim(worker_id="w", lease=LEASE, jobs=["other:1"]) is None


@pytest.mark.django_db
def test_a_claim_right_after_a_plan_folds_every_delta_it_must_first() -> None:
    # Many enqueues (each a transaction of its own) leave their counter deltas unfolded when
    # no worker ran the folder yet; the claim folds the oldest thousand waking ones itself, and
    # the plan's delta that flags the channel's new batches waits behind the rest. Here:
    # 200,000 waking deltas of another channel, a message enqueued then cancelled 100,000
    # times (they sum to nothing, so the counters stay true).
    noise = Channel.objects.create(name="noise")
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO fairqueue_channel_delta (channel_id, ready, wake) "
            "SELECT %s, CASE WHEN i %% 2 = 0 THEN 1 ELSE -1 END, true "
            "FROM generate_series(1, 200000) AS i",
            [noise.pk],
        )
    plan_job("j", "a", 1)
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None and b.job_name == "j"
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM fairqueue_channel_delta")
        assert cur.fetchone()[0] == 0
    assert batches.claim(worker_id="w", lease=LEASE) is None  # nothing more, nothing to fold


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_never_exceed_caps_nor_share_a_batch() -> None:
    try:
        for name, cap in (("t1", 1), ("t2", 2), ("t3", 3)):
            plan_job(f"job-{name}", name, 40, size=5)
            Channel.objects.filter(name=name).update(max_concurrency=cap)
        caps = {"t1": 1, "t2": 2, "t3": 3}
        lock = threading.Lock()
        running: Counter[str] = Counter()
        peak: Counter[str] = Counter()
        claimed_ids: list[int] = []
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                while True:
                    b = batches.claim(worker_id=f"w{n}", lease=LEASE)
                    if b is None:
                        if not WorkBatch.objects.filter(state="pending").exists():
                            return
                        time.sleep(0.002)
                        continue
                    with lock:
                        running[b.channel] += 1
                        peak[b.channel] = max(peak[b.channel], running[b.channel])
                        claimed_ids.append(b.id)
                    time.sleep(0.003)
                    with lock:  # leave before the slot is freed, as a real worker does
                        running[b.channel] -= 1
                    with batches.fenced(b) as fence:
                        fence.rows_processed = b.row_count
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(claimed_ids) == len(set(claimed_ids)) == 120
        assert all(peak[ch] <= cap for ch, cap in caps.items()), peak
        assert peak["t3"] >= 2  # the claimers really overlapped
        assert WorkBatch.objects.filter(state="succeeded").count() == 120
    finally:
        drop_source()


# ---------------------------------------------------------------------------------------------
# Leases, fencing, failure


@pytest.mark.django_db
def test_fenced_commits_writes_with_completion_and_refuses_a_lost_lease() -> None:
    plan_job("fence", "alice", 3)
    make_table = "CREATE TABLE fq_test_sink (k bigint PRIMARY KEY)"
    with connection.cursor() as cur:
        cur.execute(make_table)
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None
    with batches.fenced(b) as fence:
        with connection.cursor() as cur:
            cur.execute(
                "INSERT INTO fq_test_sink SELECT generate_series(%s, %s)", [b.start_id, b.end_id]
            )
        fence.rows_processed = 10
    done = WorkBatch.objects.get(pk=b.id)
    assert (done.state, done.rows_processed, done.lease_token) == ("succeeded", 10, None)
    # settling again with the old token changes nothing
    with pytest.raises(LeaseLost), batches.fenced(b):
        pytest.fail("the block must not run")
    assert batches.fail(b, "late") is None and not batches.heartbeat(b) and not batches.release(b)
    # an error inside the block rolls back the writes and leaves the batch running
    c = batches.claim(worker_id="w", lease=LEASE)
    assert c is not None
    with pytest.raises(RuntimeError), transaction.atomic(), batches.fenced(c):
        with connection.cursor() as cur:
            cur.execute("INSERT INTO fq_test_sink VALUES (-1)")
        raise RuntimeError("boom")
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM fq_test_sink WHERE k = -1")
        assert cur.fetchone()[0] == 0
    assert WorkBatch.objects.get(pk=c.id).state == "running"


@pytest.mark.django_db
def test_fail_retries_with_backoff_then_dead_letters(settings: Any) -> None:
    plan_job("flaky", "alice", 1)
    WorkBatch.objects.filter(job_name="flaky").update(max_attempts=2)
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None
    assert batches.fail(b, ValueError("bad row 7")) == "pending"
    row = WorkBatch.objects.get(pk=b.id)
    assert row.run_at > row.created_at and row.lease_token is None
    assert row.last_error["type"] == "ValueError" and "bad row 7" in row.last_error["message"]
    assert row.last_error["worker"] == "w"  # the worker that claimed it
    assert batches.claim(worker_id="w", lease=LEASE) is None  # waiting for its backoff
    WorkBatch.objects.filter(pk=b.id).update(run_at=row.created_at)
    again = batches.claim(worker_id="w", lease=LEASE)
    assert again is not None and again.attempts == 2
    assert batches.fail(again, "still bad", retry_delay_seconds=0) == "failed"
    dead = WorkBatch.objects.get(pk=b.id)
    assert dead.state == "failed" and dead.finished_at and dead.last_error["message"] == "still bad"
    assert batches.progress("flaky").state == "failed"
    # retry (idempotent), then delete only dead letters
    assert batches.retry_failed(job_name="flaky") == [b.id]
    assert batches.retry_failed(job_name="flaky") == []
    third = batches.claim(worker_id="w", lease=LEASE)
    assert third is not None and third.attempts == 1
    assert batches.fail(third, "give up", final=True) == "failed"
    assert batches.delete_failed([b.id]) == [b.id]
    assert not WorkBatch.objects.filter(pk=b.id).exists()


@pytest.mark.django_db
def test_a_lease_shorter_than_the_minimum_is_refused_and_nothing_is_claimed() -> None:
    plan_job("short", "alice", 1)
    for lease in (timedelta(seconds=-5), timedelta(0), timedelta(seconds=4.9)):
        with pytest.raises(ValueError, match="lease must be 5 to 86400 seconds"):
            batches.claim(worker_id="w", lease=lease)
    with pytest.raises(TypeError, match=r"lease must be a timedelta \(e.g. timedelta"):
        batches.claim(worker_id="w", lease=30)  # type: ignore[arg-type]
    assert WorkBatch.objects.get(job_name="short").attempts == 0
    b = batches.claim(worker_id="w", lease=timedelta(seconds=5))
    assert b is not None
    for lease in (timedelta(0), timedelta(seconds=1)):  # not the default, as 0 used to be
        with pytest.raises(ValueError, match="lease must be 5 to 86400 seconds"):
            batches.Heartbeat(b, lease=lease)
        with pytest.raises(ValueError, match="lease must be 5 to 86400 seconds"):
            batches.heartbeat(b, lease=lease)
    assert batches.Heartbeat(b).lease == timedelta(seconds=conf.get().LEASE_SECONDS)  # None
    assert batches.heartbeat(b)


@pytest.mark.django_db
def test_a_failure_records_the_worker_that_claimed_the_batch() -> None:
    plan_job("who", "alice", 1)
    b = batches.claim(worker_id="host:42", lease=LEASE)
    assert b is not None and b.worker_id == "host:42"
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        assert batches.fail(b, exc) == "pending"
    error = WorkBatch.objects.get(pk=b.id).last_error
    assert (error["type"], error["worker"], error["attempt"]) == ("RuntimeError", "host:42", 1)


@pytest.mark.django_db
def test_release_keeps_the_attempt_budget() -> None:
    plan_job("rel", "alice", 1)
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None and batches.release(b)
    row = WorkBatch.objects.get(pk=b.id)
    assert (row.state, row.attempts, row.lease_token) == ("pending", 0, None)


@pytest.mark.django_db(transaction=True)
def test_expired_lease_is_rescued_and_the_stale_worker_is_fenced_out(settings: Any) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "RETRY_BACKOFF_BASE": 0}
    try:
        plan_job("lease", "alice", 1)
        stale = batches.claim(worker_id="dead", lease=LEASE)
        assert stale is not None
        expire(stale)
        rescued = batches.rescue_expired()
        assert [(r.id, r.state, r.worker_id) for r in rescued] == [(stale.id, "pending", "dead")]
        row = WorkBatch.objects.get(pk=stale.id)
        assert row.last_error["type"] == "LeaseExpired" and "dead" in row.last_error["message"]
        fresh = batches.claim(worker_id="alive", lease=LEASE)
        assert fresh is not None and fresh.id == stale.id and fresh.attempts == 2
        # the stale worker wakes up: nothing it does lands
        assert not batches.heartbeat(stale)
        with pytest.raises(LeaseLost), batches.fenced(stale):
            pass
        assert batches.fail(stale, "late") is None
        with batches.fenced(fresh) as fence:
            fence.rows_processed = 10
        assert WorkBatch.objects.get(pk=stale.id).worker_id == "alive"
        # out of attempts: a rescued batch becomes a dead letter
        WorkBatch.objects.filter(pk=stale.id).update(state="pending", max_attempts=1, attempts=0)
        doomed = batches.claim(worker_id="dead", lease=LEASE)
        assert doomed is not None
        expire(doomed)
        assert [r.state for r in batches.rescue_expired()] == ["failed"]
    finally:
        drop_source()


@pytest.mark.django_db(transaction=True)
def test_heartbeat_thread_keeps_the_lease_and_reports_a_lost_one() -> None:
    try:
        plan_job("hb", "alice", 2)
        b = batches.claim(worker_id="w", lease=LEASE)
        assert b is not None
        with batches.Heartbeat(b, lease=LEASE, interval=0.1) as beat:
            time.sleep(0.5)
            assert batches.rescue_expired() == [] and not beat.lost.is_set()
            assert beat.beats >= 3
            assert WorkBatch.objects.get(pk=b.id).lease_expires_at > b.lease_expires_at
            WorkBatch.objects.filter(pk=b.id).update(state="pending", lease_token=None)
            assert beat.lost.wait(2.0)
    finally:
        drop_source()


# ---------------------------------------------------------------------------------------------
# Progress and cleanup


@pytest.mark.django_db
def test_progress_counts_rows_rate_and_eta() -> None:
    plan_job("prog", "alice", 4)
    p = batches.progress("prog")
    assert (p.state, p.batches_total, p.rows_total, p.rows_done, p.eta) == (
        "pending",
        4,
        40,
        0,
        None,
    )
    for _ in range(2):
        b = batches.claim(worker_id="w", lease=LEASE)
        assert b is not None
        time.sleep(0.01)
        with batches.fenced(b) as fence:
            fence.rows_processed = 10
    p = batches.progress("prog")
    assert p.state == "running" and p.rows_done == 20 and p.fraction_done == 0.5
    assert p.rows_per_second and p.rows_per_second > 0
    assert p.eta is not None and p.eta.total_seconds() == pytest.approx(20 / p.rows_per_second)
    assert p.as_dict()["batches"] == {"pending": 2, "running": 0, "succeeded": 2, "failed": 0}
    assert [j.job_name for j in batches.jobs(prefix="pr")] == ["prog"]
    with pytest.raises(LookupError, match="no work batches for job 'nope'"):
        batches.progress("nope")


@pytest.mark.django_db
def test_prune_deletes_only_whole_finished_jobs() -> None:
    plan_job("done", "alice", 2)
    plan_job("half", "bob", 2)
    for job in ("done", "done", "half"):
        b = batches.claim(worker_id="w", lease=LEASE, jobs=[job])
        assert b is not None
        with batches.fenced(b) as fence:
            fence.rows_processed = 1
    assert batches.prune(older_than=timedelta(hours=1)) == 0  # too recent
    assert batches.prune(older_than=timedelta(0)) == 2
    assert not WorkBatch.objects.filter(job_name="done").exists()
    assert WorkBatch.objects.filter(job_name="half").count() == 2


@pytest.mark.django_db
def test_channels_leave_the_claim_walk_when_drained_and_return_with_new_pending_work() -> None:
    plan_job("walk", "alice", 1)
    assert batch_pending("alice")
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None
    # running, nothing pending: the next claim takes alice out of the walk
    assert batches.claim(worker_id="w", lease=LEASE) is None
    assert not batch_pending("alice")
    # every way back to pending puts it back: fail (retry), release, rescue, retry_failed, plan
    assert batches.fail(b, "again", retry_delay_seconds=0) == "pending"
    assert batch_pending("alice")
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None and batches.claim(worker_id="w", lease=LEASE) is None
    assert batches.release(b) and batch_pending("alice")
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None and batches.claim(worker_id="w", lease=LEASE) is None
    expire(b)
    assert [r.state for r in batches.rescue_expired()] == ["pending"]
    assert batch_pending("alice")
    WorkBatch.objects.filter(pk=b.id).update(run_at=timezone.now() - timedelta(seconds=1))
    b = batches.claim(worker_id="w", lease=LEASE)
    assert b is not None and batches.fail(b, "dead", final=True) == "failed"
    assert batches.claim(worker_id="w", lease=LEASE) is None
    assert not batch_pending("alice")
    assert batches.retry_failed(job_name="walk") == [b.id]
    assert batches.claim(worker_id="w", lease=LEASE) is not None


@pytest.mark.django_db
def test_worker_maintenance_rescues_and_prunes_batches(settings: Any) -> None:
    from django_fairqueue.maintenance import BatchPruner, BatchRescuer

    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "BATCH_RETENTION": 0}
    plan_job("maint", "alice", 2)
    gone = batches.claim(worker_id="gone", lease=LEASE)
    done = batches.claim(worker_id="w", lease=LEASE)
    assert gone and done
    expire(gone)
    with batches.fenced(done) as fence:
        fence.rows_processed = 10
    assert BatchRescuer().run_once() == 1
    assert BatchPruner().run_once() == 0  # the job is not finished: one batch is pending
    WorkBatch.objects.filter(pk=gone.id).update(run_at=timezone.now() - timedelta(seconds=1))
    again = batches.claim(worker_id="w", lease=LEASE)
    assert again is not None and again.id == gone.id
    with batches.fenced(again) as fence:
        fence.rows_processed = 10
    assert BatchPruner().run_once() == 2


def test_the_api_reference_gives_each_batch_function_its_real_signature() -> None:
    """Each ``name(...)`` in the reference's work-batch table takes its arguments as the
    function does: the same positional ones, then after ``*`` keyword-only ones it has."""
    reference = (Path(__file__).parents[1] / "docs" / "reference" / "api.md").read_text()
    section = reference.split("## Work batches")[1].split("\n## ")[0]
    calls = re.findall(r"`([a-z_]+)\(([^`]*)\)`", section)
    assert len(calls) >= 12
    for name, given in calls:
        params = inspect.signature(getattr(batches, name)).parameters.values()
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        keyword = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        names = [a.split("=")[0].strip() for a in given.split(",") if a.strip()]
        star = names.index("*") if "*" in names else len(names)
        assert names[:star] == positional[:star], (name, given)
        assert set(names[star + 1 :]) <= keyword, (name, given)
