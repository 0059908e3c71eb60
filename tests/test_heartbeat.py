"""The heartbeat reports a lease lost only for a message it still holds: a message whose
outcome the settler committed while the heartbeat's renewal ran (the renewal no longer finds
it running) is settled, not lost.

The interleaving is forced: the renewal statement is wrapped so that the settler's write
commits just before it, as it does when the two threads meet on a busy worker."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from django_fairqueue.db import message_store
from django_fairqueue.worker import Outcome, Worker, WorkerConfig
from tests import fairtasks

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = timedelta(seconds=0.6)  # a renewal every 0.2 s


def _claimed_worker(count: int) -> tuple[Worker, list[message_store.ClaimedMessage]]:
    for i in range(count):
        fairtasks.add.enqueue(i, 1, channel="beat")
    worker = Worker(WorkerConfig(concurrency=count, lease=LEASE, maintenance=False))
    claimed = message_store.claim_messages(count, lease=LEASE, worker_id=worker.worker_id)
    assert len(claimed) == count
    with worker._cond:
        for m in claimed:  # as the claimer records them
            worker._unsettled[m.id] = m
    return worker, claimed


def _one_renewal(worker: Worker, monkeypatch: pytest.MonkeyPatch, before: Any) -> None:
    """Run the heartbeat loop until its first renewal returned; ``before()`` runs just before
    the renewal statement."""
    real = message_store.heartbeat_messages
    done = threading.Event()

    def renew(*args: Any, **kwargs: Any) -> dict[int, bool]:
        before()
        try:
            return real(*args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(message_store, "heartbeat_messages", renew)

    def target() -> None:
        try:
            worker._heartbeat_loop()
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    try:
        assert done.wait(10), "no renewal"
    finally:
        worker._threads_stop.set()
        thread.join(10)
    assert not thread.is_alive()


def test_a_message_settled_during_the_renewal_is_not_reported_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker, (settled, running) = _claimed_worker(2)
    deferred: list[tuple[Any, ...]] = []
    real_after_write = worker._after_write
    # the settler's write commits; its bookkeeping (dropping the message from the worker's
    # unsettled ones) has not run yet when the heartbeat looks at the renewal's result
    monkeypatch.setattr(worker, "_after_write", lambda *args: deferred.append(args))

    def settler_commits_first() -> None:
        if not deferred:
            worker.settle([Outcome(settled, "succeeded", result=3)])

    with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
        _one_renewal(worker, monkeypatch, settler_commits_first)
    ((verb, group, written),) = deferred
    assert written == {settled.id: "succeeded"}
    assert not [r for r in caplog.records if "lost the lease" in r.getMessage()]
    assert worker._lost == set()
    real_after_write(verb, group, written)  # the settler's bookkeeping completes as usual
    assert set(worker._unsettled) == {running.id}


def test_a_lease_really_lost_is_still_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker, (lost, kept) = _claimed_worker(2)

    def rescued_elsewhere() -> None:
        # its lease expired and another worker's rescuer requeued it: the token is stale
        message_store.release_messages([(lost.id, lost.lease_token)])

    with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
        _one_renewal(worker, monkeypatch, rescued_elsewhere)
    lines = [r.getMessage() for r in caplog.records if "lost the lease" in r.getMessage()]
    assert len(lines) == 1 and f"[{lost.id}]" in lines[0]
    assert worker._lost == {lost.id}
    assert kept.id in worker._unsettled


def test_a_message_claimed_again_under_a_new_token_is_not_marked_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker, (first,) = _claimed_worker(1)
    again: list[message_store.ClaimedMessage] = []

    def retried_and_claimed_again() -> None:
        # its attempt failed and was settled with an immediate retry, and this worker claimed
        # the retry (same id, new lease token) before the renewal of the old token ran
        if again:
            return
        message_store.fail_messages([(first.id, first.lease_token, {}, timedelta(0))])
        (retry,) = message_store.claim_messages(1, lease=LEASE, worker_id=worker.worker_id)
        assert retry.id == first.id and retry.lease_token != first.lease_token
        with worker._cond:
            worker._unsettled[retry.id] = retry
        again.append(retry)

    with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
        _one_renewal(worker, monkeypatch, retried_and_claimed_again)
    assert not [r for r in caplog.records if "lost the lease" in r.getMessage()]
    assert worker._lost == set()  # the retry's handler would otherwise drop it unstarted
