"""The worker's claims and completions commit without waiting for their WAL flush
(``FAIRQUEUE['ASYNC_COMMIT']``), for their own transaction only, and never a claim that hands
out an at-most-once message: lost in a database crash, that claim would run it twice."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings

from django_fairqueue import task
from django_fairqueue.db import message_store, pg
from django_fairqueue.tasks.spec import registry
from tests import factories as f

pytestmark = pytest.mark.django_db

LEASE = timedelta(minutes=5)
AT_MOST_ONCE = "tests.async_commit.at_most_once"


def synchronous_commit() -> str:
    with connection.cursor() as cur:
        cur.execute("SELECT current_setting('synchronous_commit')")
        return str(cur.fetchone()[0])


def claim_sql(limit: int, async_except: list[str] | None) -> list[int]:
    """The claim function itself, in the test's transaction (as a worker's autocommit claim
    runs it in its own)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT id FROM fairqueue_claim_v1(%s, %s, 'tests', p_async_except => %s::text[])",
            [limit, LEASE, async_except],
        )
        return [r[0] for r in cur.fetchall()]


def make_at_most_once(ids: list[int]) -> None:
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_message SET task_name = %s, max_attempts = 1 WHERE id = ANY (%s)",
            [AT_MOST_ONCE, ids],
        )


def test_a_claim_that_may_commit_early_turns_the_wal_wait_off_for_its_transaction() -> None:
    f.enqueue("plain", 2)
    assert synchronous_commit() == "on"
    assert len(claim_sql(1, [AT_MOST_ONCE])) == 1
    assert synchronous_commit() == "off"


def test_an_idle_poll_keeps_the_commit_as_it_is_unless_its_housekeeping_wrote() -> None:
    """An idle poll writes nothing, so it leaves the commit alone; one whose housekeeping
    promoted a due message (to a paused channel: still nothing to claim) relaxes it as any
    claim that writes."""
    assert claim_sql(1, [AT_MOST_ONCE]) == []
    assert synchronous_commit() == "on"
    f.enqueue("held", 1, run_after=timedelta(minutes=1))
    f.set_limits(["held"], paused=True)
    with connection.cursor() as cur:  # due now
        cur.execute("UPDATE fairqueue_message SET run_at = now() - interval '1 second'")
    assert claim_sql(1, [AT_MOST_ONCE]) == []
    with connection.cursor() as cur:
        cur.execute("SELECT state FROM fairqueue_message")
        assert [r[0] for r in cur.fetchall()] == ["ready"]  # promoted
    assert synchronous_commit() == "off"


def test_a_claim_without_the_parameter_commits_as_the_session_does() -> None:
    f.enqueue("plain", 2)
    assert len(claim_sql(1, None)) == 1
    assert synchronous_commit() == "on"


def test_a_claim_that_hands_out_an_at_most_once_message_stays_durable() -> None:
    make_at_most_once(f.enqueue("once", 1))
    f.enqueue("plain", 1)
    assert len(claim_sql(2, [AT_MOST_ONCE])) == 2
    assert synchronous_commit() == "on"


@pytest.mark.parametrize("once_queue", ["q-first", "q-second"])
def test_across_queues_an_at_most_once_claim_keeps_the_whole_transaction_durable(
    once_queue: str,
) -> None:
    # A claim of every queue claims queue by queue (one call each, in one transaction): the
    # at-most-once message may come before or after the plain one.
    f.enqueue_in_queue("q-first", "a", 1)
    f.enqueue_in_queue("q-second", "b", 1)
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_message m SET task_name = %s, max_attempts = 1 "
            "FROM fairqueue_channel c WHERE c.id = m.channel_id AND c.queue = %s",
            [AT_MOST_ONCE, once_queue],
        )
    assert len(claim_sql(10, [AT_MOST_ONCE])) == 2
    assert synchronous_commit() == "on"


def test_a_completion_that_may_commit_early_turns_the_wal_wait_off() -> None:
    f.enqueue("plain", 1)
    claimed = message_store.claim_messages(1, lease=LEASE, worker_id="tests")
    with connection.cursor() as cur:
        cur.execute(
            "SELECT fairqueue_complete_v1(%s, %s, %s, NULL, true)",
            [[claimed[0].id], [claimed[0].lease_token], [None]],
        )
    assert synchronous_commit() == "off"


def test_inside_a_callers_transaction_the_worker_calls_leave_its_durability_alone() -> None:
    f.enqueue("plain", 1)
    with transaction.atomic():
        claimed = message_store.claim_messages(1, lease=LEASE, worker_id="tests", async_commit=True)
        assert len(claimed) == 1
        assert synchronous_commit() == "on"
        done = message_store.complete_messages(
            [(claimed[0].id, claimed[0].lease_token, None)], async_commit=True
        )
        assert done == {claimed[0].id}
        assert synchronous_commit() == "on"


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The parameters of each statement the message store runs."""
    seen: list[tuple[str, dict[str, Any]]] = []
    run = pg.run_statement

    def spy(statement: str, params: dict[str, Any], using: str | None = None, **kw: Any) -> Any:
        seen.append((statement, params))
        return run(statement, params, using, **kw)

    monkeypatch.setattr(pg, "run_statement", spy)
    yield seen


@pytest.mark.django_db(transaction=True)
def test_in_a_transaction_of_its_own_the_claim_asks_for_it_naming_the_durable_tasks(
    statements: list[tuple[str, dict[str, Any]]],
) -> None:
    f.enqueue("plain", 2)
    message_store.claim_messages(
        1, lease=LEASE, worker_id="tests", async_commit=True, durable_tasks=[AT_MOST_ONCE]
    )
    message_store.claim_messages(1, lease=LEASE, worker_id="tests")
    asked = [p["async_except"] for s, p in statements if "fairqueue_claim_v1" in s]
    assert asked == [[AT_MOST_ONCE], None]
    # transaction-local: the session keeps its own setting
    assert synchronous_commit() == "on"


def test_the_worker_knows_its_at_most_once_tasks() -> None:
    def body() -> None: ...

    task(name=AT_MOST_ONCE, delivery="at_most_once")(body)
    task(name="tests.async_commit.default")(body)
    try:
        names = registry.at_most_once_names()
        assert AT_MOST_ONCE in names and "tests.async_commit.default" not in names
        with override_settings(FAIRQUEUE={"DEFAULT_DELIVERY": "at_most_once"}):
            assert "tests.async_commit.default" in registry.at_most_once_names()
    finally:
        registry.unregister(AT_MOST_ONCE)
        registry.unregister("tests.async_commit.default")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("enabled", [True, False])
def test_the_workers_claims_and_completions_ask_for_it_as_the_setting_says(
    statements: list[tuple[str, dict[str, Any]]], enabled: bool
) -> None:
    from tests.test_worker_services import claimed

    with override_settings(FAIRQUEUE={"ASYNC_COMMIT": enabled}):
        parts, (message,) = claimed(1)
        parts.work.put(message)
        parts.pool().run_once()
        assert parts.settler().run_once() == 1
    claims = [p["async_except"] for s, p in statements if "fairqueue_claim_v1" in s]
    completions = [p["async_commit"] for s, p in statements if "fairqueue_complete_v1" in s]
    assert claims == ([registry.at_most_once_names()] if enabled else [None])
    assert completions == [enabled]
