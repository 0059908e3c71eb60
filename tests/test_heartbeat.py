"""The heartbeat reports a lease lost only for a message it still holds: a message whose
outcome the settler committed while the heartbeat's renewal ran (the renewal no longer finds
it running) is settled, not lost; nor is one claimed again under a new token (a retry).

The interleaving is forced: the renewal statement is wrapped so that the other write commits
just before it, as it does when the two threads meet on a busy worker. The heartbeat runs
through ``run_once`` in the test's thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_fairqueue.db import message_store
from django_fairqueue.worker.config import lease_clock
from django_fairqueue.worker.heartbeat import Heartbeat
from django_fairqueue.worker.ledger import Ledger
from tests import fairtasks

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = timedelta(seconds=30)
WORKER = "beat-worker"


def _claimed(count: int) -> tuple[Ledger, list[message_store.ClaimedMessage]]:
    for i in range(count):
        fairtasks.add.enqueue(i, 1, channel="beat")
    ledger = Ledger(capacity=count, abort_grace=1.0)
    claimed = message_store.claim_messages(count, lease=LEASE, worker_id=WORKER)
    assert len(claimed) == count
    ledger.claimed_now(claimed, lease_clock() + LEASE.total_seconds())  # as the claimer does
    return ledger, claimed


def _renew_once(
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    before: Callable[[], None],
) -> list[str]:
    """One heartbeat pass whose renewal statement runs right after ``before()``; returns the
    "lost the lease" lines it logged."""
    real = message_store.heartbeat_messages

    def renew(*args: Any, **kwargs: Any) -> dict[int, bool]:
        before()
        return real(*args, **kwargs)

    monkeypatch.setattr(message_store, "heartbeat_messages", renew)
    with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
        Heartbeat(ledger, lease=LEASE, worker_id=WORKER).run_once()
    return [r.getMessage() for r in caplog.records if "lost the lease" in r.getMessage()]


def test_a_message_settled_during_the_renewal_is_not_reported_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger, (settled, running) = _claimed(2)

    def settler_commits_first() -> None:
        # the settler's write commits; its bookkeeping (the ledger forgetting the message)
        # has not run yet when the heartbeat looks at the renewal's result
        ledger.begin_write([settled.id])
        message_store.complete_messages([(settled.id, settled.lease_token, 3)])

    assert _renew_once(ledger, monkeypatch, caplog, settler_commits_first) == []
    assert not ledger.lease_gone(settled) and not ledger.lease_gone(running)
    ledger.forget([settled.id])  # the settler's bookkeeping completes as usual
    ledger.end_write([settled.id])
    assert ledger.unsettled_ids() == [running.id]


def test_a_lease_really_lost_is_still_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger, (lost, kept) = _claimed(2)

    def rescued_elsewhere() -> None:
        # its lease expired and another worker's rescuer requeued it: the token is stale
        message_store.release_messages([(lost.id, lost.lease_token)])

    lines = _renew_once(ledger, monkeypatch, caplog, rescued_elsewhere)
    assert len(lines) == 1 and f"[{lost.id}]" in lines[0]
    assert ledger.lease_gone(lost) and not ledger.lease_gone(kept)
    assert [i for i, _ in ledger.leases()] == [kept.id]  # a lost lease is not renewed again


def test_a_message_claimed_again_under_a_new_token_is_not_marked_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger, (first,) = _claimed(1)
    again: list[message_store.ClaimedMessage] = []

    def retried_and_claimed_again() -> None:
        # its attempt failed and was settled with an immediate retry, and this worker claimed
        # the retry (same id, new lease token) before the renewal of the old token ran
        message_store.fail_messages([(first.id, first.lease_token, {}, timedelta(0))])
        ledger.forget([first.id])
        (retry,) = message_store.claim_messages(1, lease=LEASE, worker_id=WORKER)
        assert retry.id == first.id and retry.lease_token != first.lease_token
        ledger.claimed_now([retry], lease_clock() + LEASE.total_seconds())
        again.append(retry)

    assert _renew_once(ledger, monkeypatch, caplog, retried_and_claimed_again) == []
    (retry,) = again
    assert not ledger.lease_gone(retry)  # its handler would otherwise drop it unstarted
