"""Every statement that waits for message rows locks them in id order.

The lock order (docs/explanation/fairness.md) ranks message rows "in id order within a
statement". A statement left to its plan locks rows in the order the plan visits them: a
sequential or bitmap scan follows the table's physical order, which updates reshuffle. One that
took a later id first and then waited for an earlier one would deadlock with ``abort()``, which
holding the earlier row waits for the later one (seen: an abort racing a completion batch).

Each case below makes two messages a < b with b stored before a (a's newest row version is
written after b's), lets another transaction hold a, and runs the statement on [a, b] on a
connection of its own. In id order it waits for a holding nothing, so a third connection can
still lock b; in physical order it would hold b while it waits.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection

from django_fairqueue import abort
from django_fairqueue.db import message_store
from tests import fairtasks

LEASE = timedelta(minutes=5)


def _two_messages(state: str) -> tuple[int, int, dict[int, uuid.UUID]]:
    """Messages a < b in ``state`` ('ready', 'running' or 'failed'), b stored before a."""
    a = fairtasks.add.enqueue(1, 1, channel="lock-order")
    b = fairtasks.add.enqueue(2, 2, channel="lock-order")
    tokens: dict[int, uuid.UUID] = {}
    if state in ("running", "failed"):
        tokens = {
            m.id: m.lease_token for m in message_store.claim_messages(2, lease=LEASE, worker_id="w")
        }
        assert set(tokens) == {a, b}
    if state == "failed":
        message_store.fail_messages([(i, tokens[i], {"type": "E"}, None) for i in (a, b)])
    with connection.cursor() as cur:
        # A new version of a, written after every version of b.
        cur.execute("UPDATE fairqueue_message SET priority = priority WHERE id = %s", [a])
        cur.execute("SELECT id FROM fairqueue_message WHERE id = ANY(%s) ORDER BY ctid", [[a, b]])
        assert [r[0] for r in cur.fetchall()] == [b, a], "b must be stored before a"
    return a, b, tokens


def _waits_on_a_holding_nothing(
    database_url: str, a: int, b: int, statement: Callable[[], Any]
) -> None:
    holder = psycopg.connect(database_url)
    probe = psycopg.connect(database_url)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with connection.cursor() as cur:
                # Plans that visit rows in physical order (bitmap or sequential scans), as on a
                # large table; a primary-key index scan happens to visit them in id order.
                cur.execute("SET enable_indexscan = off")
            statement()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            connection.close()

    try:
        holder.execute("SELECT id FROM fairqueue_message WHERE id = %s FOR UPDATE", [a])
        thread = threading.Thread(target=run)
        thread.start()
        # until the statement waits for a's lock
        deadline = time.monotonic() + 10
        while True:
            waiting = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
            probe.rollback()
            if waiting and waiting[0] >= 1:
                break
            assert time.monotonic() < deadline, "the statement never waited for a"
            assert thread.is_alive(), f"the statement did not wait for a: {errors}"
            time.sleep(0.02)
        row = probe.execute(
            "SELECT id FROM fairqueue_message WHERE id = %s FOR UPDATE SKIP LOCKED", [b]
        ).fetchall()
        probe.rollback()
        assert row == [(b,)], "the statement holds b while it waits for a: not in id order"
    finally:
        holder.rollback()
        holder.close()
        thread.join(timeout=20)
        probe.close()
    assert not errors, errors


CASES: dict[str, tuple[str, Callable[[int, int, dict[int, uuid.UUID]], Any]]] = {
    "complete": (
        "running",
        lambda a, b, t: message_store.complete_messages([(a, t[a], None), (b, t[b], None)]),
    ),
    "fail": (
        "running",
        lambda a, b, t: message_store.fail_messages(
            [(i, t[i], {"type": "E"}, timedelta(seconds=5)) for i in (a, b)]
        ),
    ),
    "release": ("running", lambda a, b, t: message_store.release_messages([(a, t[a]), (b, t[b])])),
    "heartbeat": (
        "running",
        lambda a, b, t: message_store.heartbeat_messages([(a, t[a]), (b, t[b])], lease=LEASE),
    ),
    "settle aborted": (
        "running",
        lambda a, b, t: message_store.settle_aborted_messages(
            [(i, t[i], {"type": "TaskAborted"}) for i in (a, b)]
        ),
    ),
    "abort running": ("running", lambda a, b, t: abort([b, a])),
    "abort waiting": ("ready", lambda a, b, t: abort([b, a])),
    "delete": ("ready", lambda a, b, t: message_store.delete_messages([b, a])),
    "retry failed": ("failed", lambda a, b, t: message_store.retry_failed_messages([b, a])),
    "delete failed": ("failed", lambda a, b, t: message_store.delete_failed_messages([b, a])),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_statement_locks_message_rows_in_id_order(case: str, database_url: str) -> None:
    state, statement = CASES[case]
    a, b, tokens = _two_messages(state)
    _waits_on_a_holding_nothing(database_url, a, b, lambda: statement(a, b, tokens))
