"""The claim and enqueue under concurrency: several threads, each with its own connection.

Every test here commits (``transaction=True``) so the other connections see the data. Threads
are enough to make PostgreSQL run the statements concurrently: psycopg releases the GIL while it
waits for the server. Each thread closes its connection when it ends.

Interval logs are taken on the client with ``time.monotonic()``: a message's logged interval
starts after its claim returned (committed) and ends before its settlement was sent, so it lies
inside the interval during which the database held it as running. Overlaps counted from the log
can therefore only under-count, never invent, a cap violation.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import override_settings

from django_fairqueue import ChannelFull
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.db import message_store
from django_fairqueue.models import Channel, Message, MessageState
from tests import factories as f

T = TypeVar("T")
LEASE = timedelta(minutes=5)
DEADLINE = 60.0  # seconds; a thread still busy after this fails the test instead of hanging


def run_threads(n: int, target: Callable[[int], T]) -> list[T]:
    """Run ``target(i)`` in ``n`` threads started together; re-raise the first error."""
    barrier = threading.Barrier(n)

    def wrapped(i: int) -> T:
        try:
            with connection.cursor() as cur:
                cur.execute("SET synchronous_commit = off")  # see test_claim._async_commit
                cur.execute("SET statement_timeout = '20s'")  # a lock wait fails, not hangs
            barrier.wait(timeout=30)
            return target(i)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(wrapped, i) for i in range(n)]
        return [future.result(timeout=DEADLINE + 30) for future in futures]


def claim(limit: int, worker: str) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id=worker)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at once (an interval ending when another starts does not overlap)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


# ------------------------------------------------------------------------------------------------
# Caps: never exceeded, slots freed exactly once


CAPS: dict[str, int | None] = {
    "cap-1": 1,
    "cap-2": 2,
    "cap-3": 3,
    "cap-5": 5,
    "free-a": None,
    "free-b": None,
}
RUNNING_OVER_CAP = """
    SELECT c.name, c.max_concurrency, count(*)
    FROM fairqueue_message m JOIN fairqueue_channel c ON c.id = m.channel_id
    WHERE m.state = 'running'
    GROUP BY c.name, c.max_concurrency
"""


@pytest.mark.django_db(transaction=True)
def test_eight_claimers_never_exceed_a_channel_cap_and_free_each_slot_once() -> None:
    per_channel = 120
    f.enqueue_spread(dict.fromkeys(CAPS, per_channel))
    for name, cap in CAPS.items():
        f.set_limits([name], max_concurrency=cap)
    total = per_channel * len(CAPS)
    lock = threading.Lock()
    completed: list[int] = []
    intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    over_cap: list[tuple[str, int, int]] = []  # (channel, cap, running) seen in a snapshot
    at_cap: set[str] = set()
    deadline = time.monotonic() + DEADLINE

    def claimer(i: int) -> None:
        rng = random.Random(i)
        worker = f"claimer-{i}"
        while True:
            with lock:
                if len(completed) >= total:
                    return
            assert time.monotonic() < deadline, "claimers did not finish in time"
            got = claim(rng.randint(1, 8), worker)
            claimed_at = time.monotonic()
            # Right after every claim: a consistent snapshot of what runs, per channel.
            with connection.cursor() as cur:
                cur.execute(RUNNING_OVER_CAP)
                for name, cap, running in cur.fetchall():
                    if cap is not None and running > cap:
                        over_cap.append((name, cap, running))
                    if cap is not None and running == cap:
                        at_cap.add(name)
            if not got:
                time.sleep(0.002)
                continue
            time.sleep(rng.uniform(0, 0.004))  # "run" the tasks
            done_at = time.monotonic()
            to_complete, to_release, to_fail = [], [], []
            for m in got:
                roll = rng.random()
                if roll < 0.1 and m.attempts < m.max_attempts:
                    to_release.append((m.id, m.lease_token))
                elif roll < 0.2 and m.attempts < m.max_attempts:
                    to_fail.append((m.id, m.lease_token, {"type": "Flaky"}, timedelta(0)))
                else:
                    to_complete.append((m.id, m.lease_token, None))
            with lock:
                for m in got:
                    intervals[m.channel].append((claimed_at, done_at))
            assert message_store.release_messages(to_release) == {r[0] for r in to_release}
            assert set(message_store.fail_messages(to_fail)) == {r[0] for r in to_fail}
            settled = message_store.complete_messages(to_complete)
            assert settled == {c[0] for c in to_complete}
            if to_complete and rng.random() < 0.2:
                assert message_store.complete_messages(to_complete) == set()  # a slot is freed once
            with lock:
                completed.extend(settled)

    run_threads(8, claimer)

    assert not over_cap, f"running over the cap in a snapshot: {over_cap[:5]}"
    for name, cap in CAPS.items():
        if cap is not None:
            most = max_overlap(intervals[name])
            assert most <= cap, f"{name}: {most} messages held at once, max_concurrency {cap}"
    assert at_cap, "no capped channel ever reached its cap: the test did not exercise caps"
    assert sorted(completed) == sorted(set(completed)) and len(completed) == total
    f.fold_all()
    for name in Channel.objects.values_list("name", flat=True):
        state = f.channel_state(name)
        running, ready = state["running_count"], state["ready_count"]
        succeeded = state["succeeded_total"]
        assert (name, running, ready, succeeded) == (name, 0, 0, per_channel)
    f.assert_counters_match_table()


# ------------------------------------------------------------------------------------------------
# Rate limit


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("alone", [False, True], ids=["with-free-channels", "alone"])
def test_rate_limited_releases_are_never_closer_than_the_interval(alone: bool) -> None:
    # Alone, the claimers find nothing else to take, so they queue for the metered channel
    # (CLAIM_WAIT) while another claim holds it: the wait must not release it early either.
    interval = timedelta(milliseconds=200)
    f.enqueue_spread(
        {"metered": 100} if alone else {"metered": 100, "free-a": 3_000, "free-b": 3_000}
    )
    f.set_limits(["metered"], release_interval=interval)
    hammer_for = 1.2  # seconds
    per_claim: list[int] = []
    lock = threading.Lock()

    def claimer(i: int) -> None:
        rng = random.Random(i)
        stop = time.monotonic() + hammer_for
        while time.monotonic() < stop:
            got = claim(rng.randint(1, 5), f"claimer-{i}")
            with lock:
                per_claim.append(sum(m.channel == "metered" for m in got))

    run_threads(4, claimer)

    assert max(per_claim) == 1  # at most one release per claim
    released = list(
        Message.objects.filter(channel__name="metered", state=MessageState.RUNNING)
        .order_by("claimed_at")
        .values_list("claimed_at", flat=True)
    )
    assert len(released) == sum(per_claim)
    gaps = [later - earlier for earlier, later in pairwise(released)]
    assert min(gaps) >= interval, f"two releases {min(gaps)} apart; interval {interval}"
    # Not vacuous: the channel did release repeatedly while hammered (about 6 in 1.2 s).
    assert len(released) >= 3, released


# ------------------------------------------------------------------------------------------------
# No double claims


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fairness", ["count", "time"])
def test_concurrent_claimers_claim_every_message_exactly_once(fairness: str) -> None:
    """Also by time, where new channels slow-start and claims that come back short are topped
    up: still one fresh token per claim, shared by exactly what it handed out."""
    with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "FAIRNESS": fairness}):
        _claim_every_message_exactly_once()


def _claim_every_message_exactly_once() -> None:
    names = [f"tenant-{i:02d}" for i in range(30)]
    enqueued = f.enqueue_spread(dict.fromkeys(names, 100))
    total = len(enqueued)
    lock = threading.Lock()
    claimed: list[list[int]] = [[] for _ in range(4)]
    tokens: list[tuple[Any, ...]] = []  # each claim's token, with the ids it handed out
    deadline = time.monotonic() + DEADLINE

    def claimer(i: int) -> None:
        rng = random.Random(i)
        while True:
            with lock:
                if sum(map(len, claimed)) >= total:
                    return
            assert time.monotonic() < deadline, "claimers did not finish in time"
            got = claim(rng.randint(1, 25), f"claimer-{i}")
            with lock:
                claimed[i].extend(m.id for m in got)
                if got:
                    tokens.append((got[0].lease_token, {m.id for m in got}))

    run_threads(4, claimer)

    every = [mid for ids in claimed for mid in ids]
    duplicates = [mid for mid, n in Counter(every).items() if n > 1]
    assert not duplicates, f"claimed twice: {duplicates[:10]}"
    assert set(every) == set(enqueued)
    assert all(claimed), "a claimer got nothing at all"
    rows = Message.objects.values_list("id", "state", "attempts", "lease_token")
    assert {(state, attempts) for _, state, attempts, _ in rows} == {(MessageState.RUNNING, 1)}
    # a fresh token per claim, shared by exactly the messages that claim handed out
    by_claim = dict(tokens)
    assert len(by_claim) == len(tokens)
    by_row: dict[Any, set[int]] = {}
    for mid, _, _, token in rows:
        by_row.setdefault(token, set()).add(mid)
    assert by_row == by_claim
    f.assert_counters_match_table()


CLAIMER_PROCESS = """
import json, os, sys, time
from datetime import timedelta

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
django.setup()
from django_fairqueue.db import message_store

barrier, limit = sys.argv[1], int(sys.argv[2])
# Start together: Django's set-up takes seconds on a busy machine.
open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
while not os.path.exists(os.path.join(barrier, "go")):
    time.sleep(0.01)
ids, empty = [], 0
while empty < 20:
    got = message_store.claim_messages(
        limit, lease=timedelta(minutes=5), worker_id=f"proc-{os.getpid()}"
    )
    ids.extend(m.id for m in got)
    empty = 0 if got else empty + 1
    if not got:
        time.sleep(0.01)
print(json.dumps(ids))
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("channels", [30, 1])
def test_claimer_processes_claim_every_message_exactly_once(
    database_url: str, tmp_path: Path, channels: int
) -> None:
    # With one channel the processes mostly queue for it (CLAIM_WAIT) instead of skipping.
    enqueued = f.enqueue_spread({f"tenant-{i:02d}": 3_000 // channels for i in range(channels)})
    env = {**os.environ, "DATABASE_URL": database_url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER_PROCESS, str(tmp_path), str(limit)],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for limit in (1, 7, 25, 100)
    ]
    deadline = time.monotonic() + DEADLINE
    while len(list(tmp_path.glob("ready-*"))) < len(procs):
        assert all(proc.poll() is None for proc in procs), "a claimer process died"
        assert time.monotonic() < deadline, "claimer processes did not start"
        time.sleep(0.05)
    (tmp_path / "go").touch()
    claimed = []
    for proc in procs:
        out, err = proc.communicate(timeout=DEADLINE + 30)
        assert proc.returncode == 0, err
        claimed.append(json.loads(out.strip().splitlines()[-1]))

    every = [mid for ids in claimed for mid in ids]
    duplicates = [mid for mid, n in Counter(every).items() if n > 1]
    assert not duplicates, f"claimed twice: {duplicates[:10]}"
    assert set(every) == set(enqueued)
    assert sum(1 for ids in claimed if ids) >= 2, "the processes did not claim concurrently"
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_a_claim_skips_a_channel_held_by_another_claim_instead_of_waiting() -> None:
    f.enqueue_spread({"alice": 3, "bob": 3})
    f.fold_all()  # else the first claim folds (and so locks) both channels
    holding = threading.Event()
    release = threading.Event()

    def slow_claimer(i: int) -> list[str]:
        with transaction.atomic():
            got = claim(1, "slow")
            holding.set()
            assert release.wait(timeout=30)
        return [m.channel for m in got]

    def fast_claimer(i: int) -> list[str]:
        assert holding.wait(timeout=30)
        try:
            return [m.channel for m in claim(10, "fast")]  # statement_timeout: no waiting
        finally:
            release.set()

    def both(i: int) -> list[str]:
        return slow_claimer(i) if i == 0 else fast_claimer(i)

    slow, fast = run_threads(2, both)

    assert slow == ["alice"]
    assert fast == ["bob"] * 3
    assert Counter(m.channel for m in claim(10, "later")) == {"alice": 2}


# ------------------------------------------------------------------------------------------------
# Several claimers, one channel: a claim that finds only held channels queues (CLAIM_WAIT)


def waiting_for_a_lock() -> int:
    """Backends of this database waiting for a lock right now (a fresh reading each call)."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = cur.fetchone()
        assert row is not None
        return int(row[0])


def hold_channel_until(event: threading.Event, holding: threading.Event) -> list[str]:
    """Claim one message inside a transaction (which never waits) and keep its channel locked
    until ``event`` is set."""
    with transaction.atomic():
        got = claim(1, "holder")
        holding.set()
        assert event.wait(timeout=30)
    return [m.channel for m in got]


@pytest.mark.django_db(transaction=True)
@override_settings(FAIRQUEUE={"CLAIM_WAIT": 10})
def test_a_claim_that_finds_only_held_channels_queues_for_them() -> None:
    f.enqueue_spread({"alice": 3})
    f.fold_all()
    holding, queued, done = threading.Event(), threading.Event(), threading.Event()

    def holder() -> list[str]:
        return hold_channel_until(queued, holding)

    def claimer() -> list[str]:
        assert holding.wait(timeout=30)
        try:
            return [m.channel for m in claim(10, "claimer")]
        finally:
            done.set()

    def watcher() -> list[str]:
        # Release the holder once the claimer is seen waiting for its lock; a claimer that came
        # back empty instead never shows up here, and the test fails.
        assert holding.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not done.is_set() and time.monotonic() < deadline:
            if waiting_for_a_lock():
                queued.set()
                return ["saw it wait"]
            time.sleep(0.002)
        queued.set()
        return []

    held, got, seen = run_threads(3, lambda i: (holder, claimer, watcher)[i]())

    assert held == ["alice"]
    assert seen == ["saw it wait"]
    assert got == ["alice", "alice"]  # served as soon as the holder committed, not empty
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
@override_settings(FAIRQUEUE={"CLAIM_WAIT": 0.2})
def test_a_claim_waits_at_most_claim_wait_then_comes_back_empty() -> None:
    f.enqueue_spread({"alice": 3})
    f.fold_all()
    holding, release = threading.Event(), threading.Event()

    def claimer() -> tuple[list[str], float]:
        assert holding.wait(timeout=30)
        began = time.monotonic()
        try:
            return [m.channel for m in claim(10, "claimer")], time.monotonic() - began
        finally:
            release.set()

    held, (got, waited) = run_threads(
        2, lambda i: hold_channel_until(release, holding) if i == 0 else claimer()
    )

    assert held == ["alice"]
    assert got == []  # the lock timeout ended the wait: no messages, as without waiting
    assert waited >= 0.2
    assert Counter(m.channel for m in claim(10, "later")) == {"alice": 2}


@pytest.mark.django_db(transaction=True)
@override_settings(FAIRQUEUE={"CLAIM_WAIT": 10})
def test_a_claim_inside_a_transaction_never_waits() -> None:
    f.enqueue_spread({"alice": 3})
    f.fold_all()
    holding, release = threading.Event(), threading.Event()

    def claimer() -> tuple[list[str], float, int]:
        assert holding.wait(timeout=30)
        try:
            with transaction.atomic():
                began = time.monotonic()
                got = claim(10, "claimer")
                waited = time.monotonic() - began
                still_usable = Channel.objects.count()  # the transaction was not aborted
            return [m.channel for m in got], waited, still_usable
        finally:
            release.set()

    _, (got, waited, channels) = run_threads(
        2, lambda i: hold_channel_until(release, holding) if i == 0 else claimer()
    )

    assert got == []
    assert waited < 5  # a wait would have lasted until the holder's release: CLAIM_WAIT, 10 s
    assert channels == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fairness", ["count", "time"])
def test_claimers_of_one_channel_come_back_empty_only_once_it_is_drained(fairness: str) -> None:
    """By time the channel slow-starts (no run time is reported): the claimers queue for it
    in the top-up as they do in the claim."""
    with override_settings(FAIRQUEUE={"CLAIM_WAIT": 5, "FAIRNESS": fairness}):
        _claimers_of_one_channel_come_back_empty_only_once_it_is_drained()


def _claimers_of_one_channel_come_back_empty_only_once_it_is_drained() -> None:
    total, claimers = 300, 4
    f.enqueue_spread({"alice": total})
    f.fold_all()
    lock = threading.Lock()
    claimed = [0]
    early_empty: list[int] = []  # claims that came back empty while ready messages remained

    def claimer(i: int) -> int:
        mine = 0
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            got = claim(1, f"claimer-{i}")
            if got:
                message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
                mine += len(got)
                with lock:
                    claimed[0] += len(got)
                continue
            with lock:
                # The other claimers may hold one claimed message each, not yet counted.
                if claimed[0] < total - (claimers - 1):
                    early_empty.append(claimed[0])
                else:
                    return mine
        return mine

    per_claimer = run_threads(claimers, claimer)

    assert sum(per_claimer) == total
    # Without the wait, about half of such claims came back empty (the channel row was held).
    assert not early_empty, f"{len(early_empty)} empty claims while work remained"
    assert sum(1 for n in per_claimer if n) >= 2, "the claimers did not share the channel"
    f.assert_counters_match_table()


# ------------------------------------------------------------------------------------------------
# Enqueue: no deadlock, max_backlog under concurrency


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_to_overlapping_channels_never_deadlock() -> None:
    bounded = [f"bounded-{i}" for i in range(4)]
    unbounded = [f"unbounded-{i}" for i in range(4)]
    f.enqueue_spread(dict.fromkeys(bounded + unbounded + ["tight"], 1))
    f.set_limits([*bounded, "tight"], max_backlog=100_000)
    f.set_limits(["tight"], max_backlog=40)
    rounds = 25
    inserted: list[int] = [*Message.objects.values_list("id", flat=True)]
    refused: list[ChannelFull] = []
    settled: list[int] = []
    lock = threading.Lock()
    enqueuers_done = threading.Event()
    finished = Counter[str]()

    def enqueuer(i: int) -> None:
        rng = random.Random(i)
        for r in range(rounds):
            names = rng.sample(bounded + unbounded, 5)
            names += [f"new-{r // 5}-{k}" for k in range(2)]  # created concurrently
            if rng.random() < 0.3:
                names.append("tight")
            batch = [EnqueueRequest(f.NOOP, (i, r), channel=rng.choice(names)) for _ in range(30)]
            rng.shuffle(batch)
            try:
                ids = enqueue_many(batch)
            except ChannelFull as exc:
                with lock:
                    refused.append(exc)
                continue
            assert len(ids) == len(batch)
            with lock:
                inserted.extend(ids)
        with lock:
            finished["enqueuers"] += 1
            if finished["enqueuers"] == 4:
                enqueuers_done.set()

    def claimer(i: int) -> None:
        while not enqueuers_done.is_set():
            got = claim(20, "claimer")
            if got:
                done = message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
                with lock:
                    settled.extend(done)
            else:
                time.sleep(0.005)

    def role(i: int) -> None:
        return claimer(i) if i == 4 else enqueuer(i)

    # New channels are bounded too.
    with override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": {"max_backlog": 100_000}}):
        run_threads(5, role)

    assert all(exc.channel == "tight" for exc in refused), refused
    remaining = set(Message.objects.values_list("id", flat=True))
    assert remaining.isdisjoint(settled)
    assert sorted(remaining | set(settled)) == sorted(inserted)
    assert len(inserted) == len(set(inserted))
    assert Channel.objects.filter(name__startswith="new-").count() == 2 * (rounds // 5)
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_concurrent_enqueuers_never_overfill_a_bounded_channel() -> None:
    f.enqueue("tight", 1)
    f.set_limits(["tight"], max_backlog=50)
    refused = Counter[int]()
    lock = threading.Lock()

    def enqueuer(i: int) -> None:
        for _ in range(20):
            try:
                f.enqueue("tight", 1)
            except ChannelFull as exc:
                assert (exc.backlog, exc.max_backlog, exc.batch) == (50, 50, 1)
                with lock:
                    refused[i] += 1

    run_threads(4, enqueuer)

    assert Message.objects.count() == 50
    assert refused.total() == 4 * 20 - 49
    f.assert_counters_match_table()
