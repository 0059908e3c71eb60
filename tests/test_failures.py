"""Failed messages: list, retry, delete (django_fairqueue.failures) and the CLI subcommand
(``manage.py fairqueue failures``, django_fairqueue.cli.failures).

Dead letters are made the way the queue makes them: enqueue, claim, fail with no retry left.
"""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import CommandParser

from django_fairqueue import failures
from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.cli import failures as failures_cli
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.exceptions import InvalidQueue
from django_fairqueue.models import Message, MessageState
from django_fairqueue.queues import row_name
from django_fairqueue.tasks import task
from django_fairqueue.testing import drain

pytestmark = pytest.mark.django_db

PARSE = "tests.failures.parse"
RENDER = "tests.failures.render"


@task(name=PARSE)
def parse(n: int) -> None:
    """Never run here."""


@task(name=RENDER)
def render(n: int) -> None:
    """Never run here."""


def make_failed(
    channel: str,
    n: int,
    name: str = PARSE,
    error: str = "bad input",
    queue: str = "default",
    error_type: str = "builtins.ValueError",
    unique_key: str | None = None,
) -> list[int]:
    """``n`` dead letters of ``channel`` (of ``queue``), failed like a worker fails an
    exhausted message."""
    ids = enqueue_many(
        EnqueueRequest(name, [i], channel=channel, queue=queue, unique_key=unique_key)
        for i in range(n)
    )
    row = row_name(queue, channel)
    channel_id = channel_store.select_channel_ids([row])[row]
    claimed = message_store.claim_messages(
        n, lease=timedelta(minutes=1), worker_id="w", only_channel_ids=[channel_id], quantum=n
    )
    assert sorted(m.id for m in claimed) == ids
    failure = {"type": error_type, "message": error, "traceback": "Traceback ..."}
    states = message_store.fail_messages([(m.id, m.lease_token, failure, None) for m in claimed])
    assert set(states.values()) == {"failed"}
    return ids


def make_held(channel: str, key: str) -> tuple[int, int]:
    """A failed unique job of ``channel`` and the message that took its ``key`` after it
    failed (due in an hour): their ids."""
    (failed,) = make_failed(channel, 1, unique_key=key)
    (holder,) = enqueue_many(
        [EnqueueRequest(PARSE, [1], channel=channel, unique_key=key, run_after=timedelta(hours=1))]
    )
    return failed, holder


def failed_count(channel: str) -> int:
    (counters,) = channel_store.select_channel_counters(
        [channel_store.select_channel_ids([channel])[channel]]
    )
    return counters.failed


def states(ids: list[int]) -> dict[int, str]:
    return dict(Message.objects.filter(pk__in=ids).values_list("pk", "state"))


# -- Python API ------------------------------------------------------------------------------


def test_list_failed_describes_each_dead_letter() -> None:
    (pk,) = make_failed("alice", 1, error="line 3: unexpected ','")
    (listed,) = failures.list_failed()
    assert (listed.id, listed.channel, listed.task) == (pk, "alice", PARSE)
    assert (listed.attempts, listed.max_attempts) == (1, 5)
    assert (listed.error_type, listed.error_message) == (
        "builtins.ValueError",
        "line 3: unexpected ','",
    )
    assert listed.finished_at is not None
    assert listed.as_dict()["finished_at"] == listed.finished_at.isoformat()


def test_list_failed_filters_and_pages() -> None:
    a = make_failed("alice", 3)
    b = make_failed("bob", 2, name=RENDER)
    enqueue_many([EnqueueRequest(PARSE, [0], channel="alice")])  # ready, never listed
    assert [m.id for m in failures.list_failed()] == a + b
    assert [m.id for m in failures.list_failed(channel="bob")] == b
    assert [m.id for m in failures.list_failed(task=PARSE)] == a
    assert failures.list_failed(channel="alice", task=RENDER) == []
    assert failures.list_failed(channel="nobody") == []
    first = failures.list_failed(limit=2)
    rest = failures.list_failed(after_id=first[-1].id)
    assert [m.id for m in first + rest] == a + b
    with pytest.raises(ValueError, match="limit"):
        failures.list_failed(limit=0)


def test_dead_letters_of_another_queue_are_named_and_selected_by_channel_and_queue() -> None:
    plain = make_failed("acme", 1)
    reports = make_failed("acme", 2, queue="reports")
    beta = make_failed("beta", 1, name=RENDER, queue="reports")
    listed = failures.list_failed()
    assert [(m.id, m.channel, m.queue) for m in listed] == [
        (plain[0], "acme", "default"),
        (reports[0], "acme", "reports"),
        (reports[1], "acme", "reports"),
        (beta[0], "beta", "reports"),
    ]
    assert listed[1].as_dict()["channel"] == "acme" and listed[1].as_dict()["queue"] == "reports"
    assert [m.id for m in failures.list_failed(channel="acme")] == plain  # the default queue
    assert [m.id for m in failures.list_failed(channel="acme", queue="reports")] == reports
    assert [m.id for m in failures.list_failed(queue="reports")] == reports + beta
    assert [m.id for m in failures.list_failed(queue="default")] == plain
    assert [m.id for m in failures.list_failed(task=RENDER, queue="reports")] == beta
    with pytest.raises(InvalidQueue):
        failures.list_failed(queue="a b")
    # the commands: a QUEUE column, the name within the queue, --queue
    lines = cli("list", "--channel", "acme", "--queue", "reports").splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [
        [str(i), "acme", "reports"] for i in reports
    ]
    assert "\\x1f" not in cli("list") and "\x1f" not in cli("list", "--json")
    assert cli("retry", "--all", "--channel", "acme", "--queue", "reports") == (
        "Retried 2 failed messages.\n"
    )
    assert states(reports) == {i: MessageState.READY for i in reports}
    assert failures.delete_all(queue="reports") == 1
    assert states(beta) == {} and states(plain) == {plain[0]: MessageState.FAILED}
    assert failures.retry_all(channel="acme", queue="default") == 1
    with pytest.raises(CommandError, match="queue name"):
        cli("list", "--queue", "a b")


def test_retry_makes_them_ready_with_a_fresh_budget_and_is_idempotent() -> None:
    ids = make_failed("alice", 3)
    ready_id = enqueue_many([EnqueueRequest(PARSE, [9], channel="alice")])[0]
    assert failures.retry([ids[0], ids[1], ready_id, 10**9]) == ids[:2]
    assert failures.retry([ids[0], ids[1]]) == []  # already retried: nothing to do
    retried = Message.objects.get(pk=ids[0])
    assert (retried.state, retried.attempts, retried.finished_at) == (MessageState.READY, 0, None)
    assert retried.last_error is not None  # the error stays for the record
    assert failed_count("alice") == 1
    # and a worker can claim them again
    claimed = message_store.claim_messages(10, lease=timedelta(minutes=1), worker_id="w")
    assert {m.id for m in claimed} == {ids[0], ids[1], ready_id}


def test_key_held_names_the_failed_jobs_a_retry_left_to_the_holder_of_their_key() -> None:
    failed, holder = make_held("alice", "job-1")
    plain = make_failed("alice", 1)
    assert failures.retry([failed, holder, *plain]) == plain
    # the holder (delayed) and the retried one were skipped or done for other reasons
    assert failures.key_held([failed, holder, *plain]) == [failed]
    assert states([failed, holder]) == {failed: MessageState.FAILED, holder: "scheduled"}
    message_store.cancel_messages([holder])  # the key is free: the retry goes through
    assert failures.retry([failed]) == [failed]
    assert failures.key_held([failed]) == []


def test_retry_rejects_non_integer_ids() -> None:
    with pytest.raises(TypeError):
        failures.retry("12")
    with pytest.raises(TypeError):
        failures.retry([1.5])  # type: ignore[list-item]


def test_retry_all_pages_through_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    a = make_failed("alice", 7)
    b = make_failed("bob", 2)
    monkeypatch.setattr(failures, "BATCH_SIZE", 3)
    calls = []
    real = message_store.retry_failed_messages

    def counted(ids: Any, **kwargs: Any) -> list[int]:
        calls.append(len(ids))
        return real(ids, **kwargs)

    monkeypatch.setattr(message_store, "retry_failed_messages", counted)
    assert failures.retry_all(channel="alice") == 7
    assert calls == [3, 3, 1]  # bounded statements
    assert set(states(a).values()) == {MessageState.READY}
    assert set(states(b).values()) == {MessageState.FAILED}
    assert failures.retry_all(channel="alice") == 0
    assert failures.retry_all() == 2
    assert (failed_count("alice"), failed_count("bob")) == (0, 0)


def test_retry_all_by_task() -> None:
    parsed = make_failed("alice", 2)
    rendered = make_failed("alice", 2, name=RENDER)
    assert failures.retry_all(task=RENDER) == 2
    assert set(states(rendered).values()) == {MessageState.READY}
    assert set(states(parsed).values()) == {MessageState.FAILED}


def test_delete_removes_only_dead_letters() -> None:
    ids = make_failed("alice", 2)
    ready_id = enqueue_many([EnqueueRequest(PARSE, [9], channel="alice")])[0]
    assert failures.delete([ids[0], ready_id]) == [ids[0]]
    assert failures.delete([ids[0]]) == []
    assert states([ids[0], ids[1], ready_id]) == {
        ids[1]: MessageState.FAILED,
        ready_id: MessageState.READY,
    }
    assert failed_count("alice") == 1


def test_delete_all_with_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "BATCH_SIZE", 2)
    make_failed("alice", 5)
    bob = make_failed("bob", 1)
    assert failures.delete_all(channel="alice") == 5
    assert failures.delete_all(channel="nobody") == 0
    assert [m.id for m in failures.list_failed()] == bob
    assert failures.delete_all() == 1
    assert failures.list_failed() == []
    assert failed_count("alice") == failed_count("bob") == 0


# -- the CLI ---------------------------------------------------------------------------------


def cli(*argv: str) -> str:
    """Parse ``argv`` as the ``failures`` subcommand does and run it; returns its output."""
    parser = CommandParser(prog="manage.py fairqueue failures")
    failures_cli.add_arguments(parser)
    options = vars(parser.parse_args(argv))
    out = io.StringIO()
    failures_cli.handle(options, out)
    return out.getvalue()


def test_cli_list_as_a_table() -> None:
    assert cli("list") == "No failed messages.\n"
    ids = make_failed("alice", 2, error="x" * 200)
    lines = cli("list", "--channel", "alice").splitlines()
    assert lines[0].split() == ["ID", "CHANNEL", "QUEUE", "TASK", "ATTEMPTS", "FINISHED", "ERROR"]
    assert [line.split()[0] for line in lines[1:]] == [str(i) for i in ids]
    assert all("builtins.ValueError: xxx" in line and line.endswith("...") for line in lines[1:])
    paged = cli("list", "--limit", "1").splitlines()
    assert paged[-1] == f"(more may follow: --after {ids[0]})"
    assert cli("list", "--after", str(ids[0])).splitlines()[1].startswith(str(ids[1]))


def test_cli_list_as_json() -> None:
    ids = make_failed("alice", 2)
    report = json.loads(cli("list", "--json", "--limit", "1"))
    assert report["next_after"] == ids[0]
    (entry,) = report["failed"]
    assert entry["id"] == ids[0]
    assert entry["channel"] == "alice"
    assert entry["task"] == PARSE
    assert entry["error_type"] == "builtins.ValueError"
    last = json.loads(cli("list", "--json", "--after", str(ids[0])))
    assert [e["id"] for e in last["failed"]] == [ids[1]]
    assert last["next_after"] is None


def test_cli_retry_and_delete_by_id() -> None:
    ids = make_failed("alice", 3)
    out = cli("retry", str(ids[0]), str(ids[1]))
    assert out == "Retried 2 failed messages.\n"
    report = json.loads(cli("retry", str(ids[0]), str(ids[2]), "--json"))
    assert report == {
        "action": "retry",
        "count": 1,
        "ids": [ids[2]],
        "skipped": [ids[0]],
        "key_held": [],
    }
    assert "Skipped (not failed): " + str(ids[0]) in cli("delete", str(ids[0]))
    assert (
        cli("retry", str(ids[0]))
        == f"Retried 0 failed messages.\nSkipped (not failed): {ids[0]}.\n"
    )
    assert states(ids) == {i: MessageState.READY for i in ids}


def test_cli_retry_tells_a_message_not_failed_from_one_whose_key_another_holds() -> None:
    failed, holder = make_held("alice", "job-1")
    (plain,) = make_failed("alice", 1)
    argv = [str(failed), str(holder), str(plain)]
    assert cli("retry", *argv) == (
        "Retried 1 failed message.\n"
        f"Skipped (not failed): {holder}.\n"
        f"Left failed (another message holds its unique key and does its work): {failed}.\n"
    )
    assert json.loads(cli("retry", *argv, "--json")) == {
        "action": "retry",
        "count": 0,
        "ids": [],
        "skipped": sorted([failed, holder, plain]),
        "key_held": [failed],
    }


def test_cli_bulk_with_all() -> None:
    make_failed("alice", 2)
    bob = make_failed("bob", 1, name=RENDER)
    assert json.loads(cli("retry", "--all", "--channel", "alice", "--json")) == {
        "action": "retry",
        "count": 2,
    }
    assert cli("delete", "--all", "--task", RENDER) == "Deleted 1 failed message.\n"
    assert states(bob) == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("retry",), "give message ids, or --all"),
        (("delete", "3", "--all"), "not both"),
        (("retry", "3", "--channel", "alice"), "only narrow --all"),
        (("delete", "3", "--queue", "reports"), "only narrow --all"),
    ],
)
def test_cli_usage_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message) as raised:
        cli(*argv)
    assert raised.value.returncode == 2  # a usage error, as argparse's


def test_cli_rejects_bad_numbers() -> None:
    with pytest.raises(CommandError):
        cli("list", "--limit", "0")
    with pytest.raises(CommandError):
        cli("retry", "abc")


def test_the_fairqueue_command_dispatches_to_failures() -> None:
    ids = make_failed("alice", 2)
    out = io.StringIO()
    call_command("fairqueue", "failures", "list", "--json", stdout=out)
    assert [e["id"] for e in json.loads(out.getvalue())["failed"]] == ids
    out = io.StringIO()
    call_command("fairqueue", "failures", "retry", "--all", stdout=out)
    assert out.getvalue() == "Retried 2 failed messages.\n"
    with pytest.raises(CommandError, match="give message ids"):
        call_command("fairqueue", "failures", "delete")


@task(name="tests.failures.long_error", max_attempts=1)
def long_error() -> None:
    """Fails with a 20,000-character message, chained to another: a traceback over 40,000."""
    try:
        raise RuntimeError("c" * 20_000)
    except RuntimeError as cause:
        raise ValueError("m" * 20_000) from cause


def test_a_long_error_is_stored_within_the_documented_limits() -> None:
    """docs/howto/delivery-modes.md: the message at most 8,000 characters, the traceback its
    last 32,000, the mark of the cut included."""
    mid = enqueue(long_error, channel="alice")
    assert drain() == 1
    error = Message.objects.get(pk=mid).last_error
    assert (len(error["message"]), len(error["traceback"])) == (8_000, 32_000)
    assert error["message"] == "m" * 7_995 + "[...]"
    assert error["traceback"].startswith("[...]")
    assert error["traceback"].endswith("ValueError: " + "m" * 20_000 + "\n")
