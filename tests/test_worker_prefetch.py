"""``WorkerConfig.prefetch``: claims beyond the free handler threads, and what a stop does with
the messages claimed but not started."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from django_fairqueue import store
from django_fairqueue.models import Message, MessageState
from django_fairqueue.worker import Worker, WorkerConfig
from tests import fairtasks
from tests.workerkit import counters, wait_until


def worker(**config: Any) -> Worker:
    return Worker(WorkerConfig(worker_id="prefetch", listen=False, maintenance=False, **config))


def recording_claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(limit asked, messages got) of every claim the worker makes."""
    claims: list[tuple[int, int]] = []
    real = store.claim_messages

    def claim(limit: int, **kwargs: Any) -> list[store.ClaimedMessage]:
        got = real(limit, **kwargs)
        claims.append((limit, len(got)))
        return got

    monkeypatch.setattr(store, "claim_messages", claim)
    return claims


def test_prefetch_must_be_a_non_negative_integer() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch"):
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
