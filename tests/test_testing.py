"""django_fairqueue.testing as a project's tests use it: enqueued() with every kind of task,
and run_worker(), a real worker process on the test's database."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import User

from django_fairqueue.exceptions import InvalidChannel, InvalidQueue
from django_fairqueue.models import Message, MessageState
from django_fairqueue.tasks.django_compat import task
from django_fairqueue.testing import enqueued, run_worker
from tests import fairtasks


@task
def send_invoice(invoice_id: int) -> int:
    return invoice_id


@task(backend="immediate")
def run_in_process(x: int) -> int:
    return x


@pytest.mark.django_db
def test_enqueued_finds_a_django_task_by_the_name_its_backend_registered() -> None:
    send_invoice.using(channel="alice").enqueue(7)
    fairtasks.add.enqueue(1, 2, channel="alice")
    [message] = enqueued(task=send_invoice, channel="alice")
    assert message.task_name == "tests.test_testing.send_invoice"
    assert message.payload["args"] == [7]
    # a copy made with using() is the same task
    assert enqueued(task=send_invoice.using(priority=5)) == [message]
    assert len(enqueued(task=fairtasks.add.using(channel="bob"))) == 1


@pytest.mark.django_db
def test_enqueued_refuses_what_names_no_task_of_this_queue() -> None:
    with pytest.raises(ValueError, match="backend 'immediate', which is not a FairQueueBackend"):
        enqueued(task=run_in_process)
    with pytest.raises(TypeError, match=r"task must be a task name, .* got function"):
        enqueued(task=fairtasks.add.__wrapped__)


@pytest.mark.django_db
def test_enqueued_refuses_a_channel_or_queue_no_message_can_have() -> None:
    fairtasks.add.enqueue(1, 2, channel="acme")
    with pytest.raises(InvalidChannel, match="must not start or end with blanks"):
        enqueued(channel=" acme")  # found nothing before: a test asserting none passed
    with pytest.raises(InvalidChannel, match="must not be empty"):
        enqueued(channel="")
    with pytest.raises(InvalidQueue):
        enqueued(queue="a b")
    assert len(enqueued(channel="acme")) == 1
    user = User.objects.create(username="acme")  # a model instance names its channel
    fairtasks.add.enqueue(3, 4, channel=user)
    assert [m.payload["args"] for m in enqueued(channel=user)] == [[3, 4]]


@pytest.mark.django_db(transaction=True)
def test_run_worker_runs_a_worker_process_on_the_test_database() -> None:
    mid = fairtasks.add.enqueue(2, 3, channel="alice")
    done = run_worker("--burst-horizon", "0")
    assert "1 messages handled" in done.stderr, done.stderr
    row = Message.objects.get(pk=mid)
    assert (row.state, row.result) == (MessageState.SUCCEEDED, 5)


@pytest.mark.django_db(transaction=True)
def test_run_worker_gives_the_test_database_to_each_of_several_processes() -> None:
    ids = [fairtasks.add.enqueue(i, i, channel=f"c{i}") for i in range(4)]
    run_worker("--processes", "2", "--burst-horizon", "0")
    states = set(Message.objects.filter(pk__in=ids).values_list("state", flat=True))
    assert states == {MessageState.SUCCEEDED}


@pytest.mark.django_db(transaction=True)
def test_run_worker_past_its_timeout_kills_the_supervisor_and_its_children() -> None:
    """A supervised child is in a session of its own and outlives its supervisor's group."""
    fairtasks.sleep.enqueue(120, channel="slow")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"still ran after 3 s and was killed"):
        run_worker("--processes", "2", "--burst-horizon", "0", timeout=3)
    assert time.monotonic() - began < 15  # not the child's grace period (30 s), nor the task


@pytest.mark.django_db
def test_run_worker_inside_the_tests_transaction_says_why_it_cannot_work() -> None:
    with pytest.raises(RuntimeError, match=r"transaction=True"):
        run_worker()


@pytest.mark.django_db(transaction=True)
def test_run_worker_reports_a_failing_worker_with_its_output() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 1.*--concurrency must be"):
        run_worker("--concurrency", "0")
