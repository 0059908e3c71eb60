"""``WorkerConfig.prefetch``: claims beyond the free handler threads, and what a stop does with
the messages claimed but not started."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from django_fairqueue.db import message_store
from django_fairqueue.models import Message, MessageState
from django_fairqueue.worker import Worker, WorkerConfig
from tests import fairtasks
from tests.workerkit import counters, wait_until


def worker(**config: Any) -> Worker:
    return Worker(WorkerConfig(worker_id="prefetch", listen=False, maintenance=False, **config))


def recording_claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(limit asked, messages got) of every claim the worker makes."""
    claims: list[tuple[int, int]] = []
    real = message_store.claim_messages

    def claim(limit: int, **kwargs: Any) -> list[message_store.ClaimedMessage]:
        got = real(limit, **kwargs)
        claims.append((limit, len(got)))
        return got

    monkeypatch.setattr(message_store, "claim_messages", claim)
    return claims


def test_prefetch_must_be_a_non_negative_integer() -> None:
    with pytest.raises(ValueError, match="prefetch must be 0 to 10000, got -1"):
        WorkerConfig(prefetch=-1)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="prefetch must be an integer"):
            WorkerConfig(prefetch=bad)


@pytest.mark.django_db(transaction=True)
def test_runfairworker_refuses_a_negative_prefetch() -> None:
    with pytest.raises(CommandError, match="--prefetch"):
        call_command("runfairworker", "--burst", "--prefetch", "-1")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("prefetch", "first_claim"), [(0, 1), (3, 4)])
def test_a_claim_takes_free_threads_plus_prefetch(
    monkeypatch: pytest.MonkeyPatch, prefetch: int, first_claim: int
) -> None:
    ids = [fairtasks.add.enqueue(i, 1, channel="alice") for i in range(6)]
    claims = recording_claims(monkeypatch)

    handled = worker(concurrency=1, prefetch=prefetch, burst=True).run()

    assert handled == 6
    assert claims[0] == (first_claim, first_claim)
    assert max(limit for limit, _ in claims) == first_claim
    rows = Message.objects.filter(pk__in=ids)
    assert {(r.state, r.result) for r in rows} == {
        (MessageState.SUCCEEDED, i + 1) for i in range(6)
    }
    assert counters("alice").running == 0


@pytest.mark.django_db(transaction=True)
def test_a_graceful_stop_gives_back_prefetched_messages_at_once() -> None:
    started = threading.Event()
    release = threading.Event()

    ids = [fairtasks.sleep.enqueue(0.0, channel="alice") for _ in range(4)]
    w = worker(concurrency=1, prefetch=3, shutdown_grace=30.0)

    from django_fairqueue.signals import message_started

    def hold_first(**kwargs: Any) -> None:
        if not started.is_set():
            started.set()
            release.wait(10)  # the first message runs until the stop has been asked for

    message_started.connect(hold_first, weak=False)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["handled"] = w.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    try:
        thread.start()
        assert started.wait(10)
        assert counters("alice").running == 4  # one running, three prefetched
        w.stop()
        # the three waiting for the thread are given back without waiting for it
        wait_until(
            lambda: Message.objects.filter(pk__in=ids, state=MessageState.READY).count() == 3,
            what="prefetched messages released",
        )
        release.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        release.set()
        message_started.disconnect(hold_first)
    assert outcome["handled"] == 1
    rows = {r.pk: r for r in Message.objects.filter(pk__in=ids)}
    assert sorted((r.state, r.attempts) for r in rows.values()) == sorted(
        [(MessageState.SUCCEEDED, 1)] + [(MessageState.READY, 0)] * 3
    )
    assert counters("alice").running == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("heartbeat", ["finds_the_leases_lost", "cannot_reach_the_database"])
def test_prefetched_messages_whose_lease_expired_are_dropped_not_started(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, heartbeat: str
) -> None:
    """A worker frozen or cut off past the lease must not start what it claimed before: the
    rescuer gives those messages to another worker, and running them here too runs them twice.
    The heartbeat either reports the leases lost, or never comes back (the database hangs):
    then only the worker's own clock tells the leases are over."""
    from django_fairqueue.signals import message_started

    lease = 0.5
    started: list[int] = []
    first_started = threading.Event()
    unblock = threading.Event()

    def hold_first(message: Any, **kwargs: Any) -> None:
        started.append(message.id)
        if not first_started.is_set():
            first_started.set()
            time.sleep(3 * lease)  # the first message outlasts every lease of the claim

    def heartbeat_messages(leases: Any, **kwargs: Any) -> dict[int, bool]:
        if heartbeat == "cannot_reach_the_database":
            unblock.wait(30)
            return {message_id: False for message_id, _ in leases}
        return {}  # every lease renewed was found expired (taken over)

    monkeypatch.setattr(message_store, "heartbeat_messages", heartbeat_messages)
    ids = [fairtasks.sleep.enqueue(0.0, channel="alice") for _ in range(4)]
    w = worker(concurrency=1, prefetch=3, lease=timedelta(seconds=lease))
    message_started.connect(hold_first, weak=False)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["handled"] = w.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    try:
        with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
            thread.start()
            assert first_started.wait(10)
            assert counters("alice").running == 4  # one running, three prefetched
            wait_until(lambda: Message.objects.get(pk=ids[0]).state == MessageState.SUCCEEDED)
            time.sleep(0.3)  # time for the handler to start the next ones, if it would
            w.stop()
            unblock.set()
            thread.join(30)
            assert not thread.is_alive()
    finally:
        unblock.set()
        message_started.disconnect(hold_first)
    assert started == ids[:1]
    assert outcome["handled"] == 1
    # neither run nor written back: left to the rescuer, as by a worker that died
    rows = Message.objects.filter(pk__in=ids[1:])
    assert {(r.state, r.attempts, r.worker_id) for r in rows} == {
        (MessageState.RUNNING, 1, "prefetch")
    }
    dropped = [r for r in caplog.records if r.getMessage().startswith("not starting message")]
    assert sorted(r.message_id for r in dropped) == ids[1:]  # type: ignore[attr-defined]
