"""What docs/howto/observability.md promises a project that watches the queue: the
``message_enqueued`` signal names the messages an enqueue stored, and every failed attempt,
a lease the rescuer took back included, is a worker record with the documented fields."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction

from django_fairqueue import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.db import message_store
from django_fairqueue.exceptions import DuplicateJob
from django_fairqueue.maintenance import Rescuer
from django_fairqueue.signals import message_enqueued
from tests import fairtasks

# ------------------------------------------------------------------------------------------------
# message_enqueued


@pytest.fixture
def sent() -> Iterator[list[dict[str, Any]]]:
    """The ``message_enqueued`` signals sent during the test (their keyword arguments)."""
    got: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append(kwargs)

    message_enqueued.connect(receiver)
    try:
        yield got
    finally:
        message_enqueued.disconnect(receiver)


def ids_sent(sent: list[dict[str, Any]]) -> list[list[int]]:
    return [s["message_ids"] for s in sent]


@pytest.mark.django_db
def test_a_batch_reports_the_message_its_requests_of_one_key_stored_once(
    sent: list[dict[str, Any]],
) -> None:
    requests = [
        EnqueueRequest(fairtasks.add, (1, 1), channel="sig", unique_key="b"),
        EnqueueRequest(fairtasks.add, (2, 2), channel="other", unique_key="b"),
        EnqueueRequest(fairtasks.add, (3, 3), channel="sig", unique_key="b"),
        EnqueueRequest(fairtasks.add, (4, 4), channel="sig", on_conflict="replace", unique_key="b"),
        EnqueueRequest(fairtasks.add, (5, 5), channel="sig"),
    ]
    b, other, b_again, b_replaced, keyless = enqueue_many(requests)
    assert b == b_again == b_replaced and len({b, other, keyless}) == 3
    assert sent == [
        {
            "signal": message_enqueued,
            "message_ids": [b, other, keyless],
            "channels": ["sig", "other", "sig"],
            "queues": ["default", "default", "default"],
        }
    ]


@pytest.mark.django_db
def test_a_unique_enqueue_that_raises_sends_nothing(sent: list[dict[str, Any]]) -> None:
    holder = enqueue(fairtasks.add, 1, 1, channel="sig", unique_key="rebuild")
    with pytest.raises(DuplicateJob), transaction.atomic():
        enqueue(fairtasks.add, 2, 2, channel="sig", unique_key="rebuild", on_conflict="raise")
    with pytest.raises(DuplicateJob), transaction.atomic():
        enqueue_many(
            [
                EnqueueRequest(fairtasks.add, (3, 3), channel="sig", unique_key="new"),
                EnqueueRequest(
                    fairtasks.add, (4, 4), channel="sig", unique_key="rebuild", on_conflict="raise"
                ),
            ]
        )
    assert ids_sent(sent) == [[holder]]


@pytest.mark.django_db
def test_an_expired_lease_is_logged_as_the_worker_logs_a_failed_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    retried = enqueue(fairtasks.sleep, 0, channel="acme", queue="reports")
    failed = fairtasks.at_most_once.enqueue(channel=("globex", "bob"))
    claimed = message_store.claim_messages(2, lease=timedelta(milliseconds=1), worker_id="dead")
    assert {m.id for m in claimed} == {retried, failed}
    time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="django_fairqueue"):
        assert Rescuer().run_once() == 2
    records = {r.message_id: r for r in caplog.records if "lease expired" in r.getMessage()}
    got = {
        mid: (r.name, r.levelno, r.channel, r.queue, r.task, r.attempt, r.outcome)  # type: ignore[attr-defined]
        for mid, r in records.items()
    }
    assert got == {
        retried: (
            "django_fairqueue.worker",
            logging.WARNING,
            "acme",
            "reports",
            fairtasks.sleep.name,
            1,
            "retry",
        ),
        failed: (
            "django_fairqueue.worker",
            logging.WARNING,
            "globex/bob",
            "default",
            fairtasks.at_most_once.name,
            1,
            "failed",
        ),
    }
    assert f"message {retried} channel 'acme'" in records[retried].getMessage()
