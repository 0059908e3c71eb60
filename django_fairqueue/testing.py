"""Helpers for testing code that uses django-fairqueue.

``drain()`` runs queued messages in the test's own thread with the real worker code (claim,
run, settle), so it works inside a test's transaction (``TestCase``, ``@pytest.mark.django_db``)
and sees the test's uncommitted data. ``enqueued()`` lists what is waiting, to assert that code
enqueued what it should::

    def test_upload_enqueues_conversion(client):
        client.post("/upload/", {...})
        [message] = enqueued(task=convert_document, channel="alice")
        assert message.payload["args"] == [42]
        assert drain() == 1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django_fairqueue.models import Message, MessageState
from django_fairqueue.queues import DEFAULT_QUEUE, row_name
from django_fairqueue.tasks import FairTask, TaskSpec
from django_fairqueue.worker import Worker, WorkerConfig


def drain(channels: str | Sequence[str] | None = None, max_messages: int | None = None) -> int:
    """Run ready messages until none is ready (or ``max_messages`` ran); returns how many ran.

    Messages run one at a time, in the fair order workers would claim them, in the calling
    thread. A failing task is retried as a worker would: a retry whose backoff has not passed is
    not ready, so ``drain()`` stops before it (set ``FAIRQUEUE['RETRY_BACKOFF_BASE'] = 0`` to run
    every attempt at once). Inside a transaction each task runs in a savepoint.
    """
    if isinstance(channels, str):
        channels = [channels]
    worker = Worker(
        WorkerConfig(
            concurrency=1,
            batch_size=1,
            channels=tuple(channels or ()),
            burst=True,
            max_messages=max_messages,
            worker_id="django_fairqueue.testing.drain",
            listen=False,
            maintenance=False,
        )
    )
    total = 0
    while max_messages is None or total < max_messages:
        handled = worker.run_once()
        if handled == 0:
            break
        total += handled
    return total


def enqueued(
    task: str | FairTask[Any, Any] | TaskSpec | None = None,
    channel: str | None = None,
    queue: str | None = None,
) -> list[Message]:
    """Messages waiting to run (ready or scheduled), oldest first, optionally of one task,
    channel and/or queue. ``task`` is a task name or the registered task; ``channel`` is a
    channel of ``queue`` (of the default queue without one), and ``queue`` alone selects every
    channel of that queue."""
    messages = Message.objects.filter(state__in=[MessageState.READY, MessageState.SCHEDULED])
    if task is not None:
        name = task if isinstance(task, str) else task.name
        messages = messages.filter(task_name=name)
    if channel is not None:
        messages = messages.filter(channel__name=row_name(queue or DEFAULT_QUEUE, channel))
    elif queue is not None:
        messages = messages.filter(channel__queue=queue)
    return list(messages.select_related("channel").order_by("id"))
