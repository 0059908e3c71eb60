"""The message table's CHECK constraints in their compact stored forms (migration
0018_faster_enqueue) accept exactly the rows the forms Django generates from the model accept;
the tables every claim updates carry no CHECK another one implies."""

from __future__ import annotations

import importlib
import itertools
import uuid

import pytest
from django.db import connection, transaction
from django.db.utils import IntegrityError

from tests import factories as f

FASTER = importlib.import_module("django_fairqueue.migrations.0018_faster_enqueue")

STATES = ("scheduled", "ready", "running", "succeeded", "failed", "cancelled", "aborted", "bogus")
SCOPES = (None, "queued", "active", "bogus")


def _rows() -> list[tuple[object, ...]]:
    """Every combination of the values the four constraints look at."""
    token = str(uuid.uuid4())
    return list(
        itertools.product(
            STATES,
            (None, token),  # lease_token
            (None, "2026-01-01T00:00:00Z"),  # lease_expires_at
            ("", "t"),  # task_name
            (None, "k"),  # unique_key
            SCOPES,  # unique_scope
        )
    )


def _violates(table: str, row: tuple[object, ...]) -> str | None:
    """The constraint the row violates in ``table`` (None: accepted, and rolled back)."""
    state, token, expires, task, key, scope = row
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(
                f"INSERT INTO {table} (channel_id, task_name, payload, priority, state, run_at,"
                " enqueued_at, attempts, max_attempts, keep_result, worker_id, lease_token,"
                " lease_expires_at, unique_key, unique_scope)"
                " VALUES (1, %s, '{}', 0, %s, now(), now(), 0, 1, false, '', %s, %s, %s, %s)",
                [task, state, token, expires, key, scope],
            )
            raise _Accepted
    except _Accepted:
        return None
    except IntegrityError as exc:
        return str(exc.__cause__.diag.constraint_name)  # type: ignore[union-attr]


class _Accepted(Exception):
    pass


@pytest.mark.django_db
def test_compact_checks_accept_exactly_what_djangos_forms_accept() -> None:
    with connection.cursor() as cur:
        # the same table with the forms Django generates (no other constraints, no indexes)
        cur.execute(
            "CREATE TEMP TABLE django_forms"
            " (LIKE fairqueue_message INCLUDING DEFAULTS INCLUDING IDENTITY)"
            " ON COMMIT DROP"
        )
        for name, (_compact, django_form) in FASTER.FORMS.items():
            cur.execute(f"ALTER TABLE django_forms ADD CONSTRAINT {name} CHECK ({django_form})")
        cur.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'fairqueue_message'::regclass"
            " AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%ARRAY[%'"
        )
        assert cur.fetchall() == []  # the compact forms are the ones installed
    rows = _rows()
    compact = [_violates("fairqueue_message", row) for row in rows]
    django = [_violates("django_forms", row) for row in rows]
    # (A row breaking several constraints may name a different one of them in each table.)
    assert [c is None for c in compact] == [d is None for d in django]
    assert compact.count(None) == django.count(None) > 0
    assert {c for c in compact if c} == set(FASTER.FORMS)
    # each constraint alone, on otherwise valid rows
    token = str(uuid.uuid4())
    cases = {
        ("bogus", None, None, "t", None, None): "fq_message_state_valid",
        ("running", None, None, "t", None, None): "fq_message_lease_iff_running",
        ("running", token, None, "t", None, None): "fq_message_lease_iff_running",
        ("ready", token, None, "t", None, None): "fq_message_lease_iff_running",
        ("ready", None, None, "", None, None): "fq_message_task_name",
        ("ready", None, None, "t", None, "queued"): "fq_message_unique_scope",
        ("ready", None, None, "t", "k", "bogus"): "fq_message_unique_scope",
    }
    for row, name in cases.items():
        assert _violates("fairqueue_message", row) == name, row
    # the NULL case a CHECK lets through: a key without a scope passes both forms
    assert _violates("fairqueue_message", ("ready", None, None, "t", "k", None)) is None
    assert (
        _violates("fairqueue_message", ("running", token, "2026-01-01", "t", "k", "active")) is None
    )


@pytest.mark.django_db
def test_the_tables_a_claim_updates_carry_no_check_another_implies() -> None:
    # PostgreSQL parses and evaluates every CHECK of a table at each update of a row, whatever
    # columns change: a positive integer field's ">= 0" beside a range constraint cost every
    # claim, fold and settlement for nothing.
    with connection.cursor() as cur:
        cur.execute(
            "SELECT conrelid::regclass::text, conname FROM pg_constraint"
            " WHERE contype = 'c' AND conrelid::regclass::text IN"
            " ('fairqueue_channel', 'fairqueue_channel_group', 'fairqueue_message')"
        )
        checks = set(cur.fetchall())
        cur.execute(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
            " WHERE tgname = 'fairqueue_group_counters'"
        )
        (counters_trigger,) = cur.fetchone()
    assert checks == {
        ("fairqueue_channel", "fq_channel_name_trimmed"),
        ("fairqueue_channel", "fq_channel_max_concurrency_range"),
        ("fairqueue_channel", "fq_channel_release_interval_range"),
        ("fairqueue_channel", "fq_channel_weight_range"),
        ("fairqueue_channel", "fq_channel_max_backlog_positive"),
        ("fairqueue_channel", "fairqueue_channel_turn_used_check"),
        ("fairqueue_channel", "fairqueue_channel_batch_turn_used_check"),
        ("fairqueue_channel_group", "fq_group_name_valid"),
        ("fairqueue_channel_group", "fq_group_max_concurrency_range"),
        ("fairqueue_channel_group", "fq_group_release_interval_range"),
        ("fairqueue_channel_group", "fq_group_weight_range"),
        ("fairqueue_message", "fq_message_state_valid"),
        ("fairqueue_message", "fq_message_max_attempts_positive"),
        ("fairqueue_message", "fq_message_lease_iff_running"),
        ("fairqueue_message", "fq_message_task_name"),
        ("fairqueue_message", "fq_message_priority_range"),
        ("fairqueue_message", "fq_message_unique_scope"),
        ("fairqueue_message", "fairqueue_message_attempts_check"),
    }, checks
    # The group sums' trigger: its WHEN clause (parsed by each statement that updates a
    # channel's counters) asks only whether the channel is grouped.
    when = counters_trigger.split(" WHEN ", 1)[1].split(" EXECUTE ", 1)[0]
    assert when == "(((old.group_id IS NOT NULL) OR (new.group_id IS NOT NULL)))", when


@pytest.mark.django_db
def test_a_range_constraint_still_refuses_what_the_dropped_check_refused() -> None:
    f.enqueue("c", 1)
    cases = {
        "fairqueue_channel SET weight": "fq_channel_weight_range",
        "fairqueue_channel SET max_concurrency": "fq_channel_max_concurrency_range",
        "fairqueue_channel SET max_backlog": "fq_channel_max_backlog_positive",
        "fairqueue_message SET max_attempts": "fq_message_max_attempts_positive",
    }
    with connection.cursor() as cur:
        for update, constraint in cases.items():
            with pytest.raises(IntegrityError) as raised, transaction.atomic():
                cur.execute(f"UPDATE {update} = -1")
            diag = raised.value.__cause__.diag  # type: ignore[union-attr]
            assert diag.constraint_name == constraint
