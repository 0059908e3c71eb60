"""One client process of the stress test: a seeded random mix of every public operation.

    python -m tests.stressclient --seed S --client N --seconds T --channels a,b,... --out F

Run by tests/test_stress.py with ``DATABASE_URL`` naming the test database (tests/settings.py
uses it). Every enqueue also notes its ids in ``stress_enqueued`` in the same transaction, so
the table holds exactly the committed messages. Every limit edit is noted in
``stress_limit_edit`` in the edit's own transaction (the cap check forgives a channel over a
cap lowered under running work). At the end the client writes what it did (operations by
kind, errors with their text) to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, transaction

#: Task arguments: mostly fast no-ops; some fail once (retried), some always (dead letters,
#: ``max_attempts`` 3), a few sleep.
BEHAVIOURS: list[tuple[float, float, int]] = [  # (weight, seconds, fail_attempts)
    (70, 0.0, 0),
    (10, 0.0, 1),
    (6, 0.0, 99),
    (8, 0.05, 0),
    (3, 0.3, 0),
    (3, 0.2, 1),
]


class Rollback(Exception):
    """Raised inside an atomic block on purpose: nothing of it may be committed."""


class Client:
    def __init__(self, seed: str, number: int, channels: Sequence[str]) -> None:
        from django_fairqueue.models import Channel

        self.rng = random.Random(seed)
        self.number = number
        self.channels = list(channels)
        self.new_channels = 0
        self.ops: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[dict[str, str]] = []
        self.enqueued = 0
        self.rolled_back_ids: list[int] = []
        # Channel instances loaded some seconds ago, saved whole later (a stale edit form).
        self.loaded: list[tuple[float, Channel]] = []

    # -- helpers ---------------------------------------------------------------------------

    def channel(self) -> str:
        return self.rng.choice(self.channels)

    def request(self, channel: str) -> Any:
        from django_fairqueue import EnqueueRequest
        from tests import stresstasks

        rng = self.rng
        weights = [b[0] for b in BEHAVIOURS]
        _, seconds, fail_attempts = rng.choices(BEHAVIOURS, weights=weights)[0]
        fn = stresstasks.kept if rng.random() < 0.1 else stresstasks.work
        run_after = timedelta(seconds=rng.uniform(0.1, 1.5)) if rng.random() < 0.08 else None
        return EnqueueRequest(
            fn,
            kwargs={"seconds": seconds, "fail_attempts": fail_attempts},
            channel=channel,
            run_after=run_after,
            priority=rng.choice((0, 0, 0, 5, -5)),
            # a third of the work goes to queue "reports" (the same tenants' channels there)
            queue="reports" if rng.random() < 1 / 3 else None,
        )

    def note(self, ids: list[int], channels: list[str]) -> None:
        """Note committed-to-be ids in the caller's transaction."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                # a unique job kept or replaced returns its holder's id, noted already
                "INSERT INTO stress_enqueued (message_id, channel, client) "
                "SELECT * FROM unnest(%s::bigint[], %s::text[], "
                "array_fill(%s::integer, ARRAY[%s])) ON CONFLICT DO NOTHING",
                [ids, channels, self.number, len(ids)],
            )

    def enqueue_calls(self, channels: list[str], rollback: bool, pause: float) -> None:
        """One ``enqueue()`` call per channel, in this order, in one transaction."""
        from django_fairqueue import enqueue

        ids: list[int] = []
        try:
            with transaction.atomic():
                for i, name in enumerate(channels):
                    r = self.request(name)
                    mid = enqueue(
                        r.task,
                        channel=name,
                        run_after=r.run_after,
                        priority=r.priority,
                        **r.kwargs,
                    )
                    ids.append(mid)
                    self.note([mid], [name])
                    if pause and i + 1 < len(channels):
                        time.sleep(pause)  # a view doing work between its enqueues
                if rollback:
                    raise Rollback
        except Rollback:
            self.rolled_back_ids.extend(ids)
            self.outcomes["rolled_back"] += 1
            return
        self.enqueued += len(ids)

    def edited(self, names: list[str], how: str) -> None:
        """Note a limit edit in its own transaction, after its write: the note commits with
        the edit, and its time is after the edit locked the channel rows, so a claim charged
        later than that saw the new limits (a claim holds the row until it commits)."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO stress_limit_edit (channel, how, at) "
                "SELECT n, %s, clock_timestamp() FROM unnest(%s::text[]) AS n",
                [how, names],
            )

    def limits(self, name: str) -> dict[str, Any]:
        """New limits for a channel; the bounded ones (``b*``) stay bounded."""
        rng = self.rng
        backlogs = (20, 40, 60) if name.startswith("b") else (None, None, None, 20, 60)
        return {
            "max_concurrency": rng.choice((None, 1, 2, 2, 3, 4)),
            "weight": rng.choice((1, 1, 2, 3)),
            "release_interval": timedelta(milliseconds=rng.choice((0, 0, 0, 20))),
            "max_backlog": rng.choice(backlogs),
        }

    # -- operations ------------------------------------------------------------------------

    def op_enqueue_one(self) -> None:
        self.enqueue_calls([self.channel()], rollback=False, pause=0)

    def op_enqueue_many(self) -> None:
        from django_fairqueue import enqueue_many

        rng = self.rng
        names = rng.sample(self.channels, rng.randint(1, 4))
        chosen = [rng.choice(names) for _ in range(rng.randint(1, 20))]
        rollback = rng.random() < 0.15
        try:
            with transaction.atomic():
                ids = enqueue_many([self.request(n) for n in chosen])
                self.note(ids, chosen)
                if rollback:
                    raise Rollback
        except Rollback:
            self.rolled_back_ids.extend(ids)
            self.outcomes["rolled_back"] += 1
            return
        self.enqueued += len(ids)

    def op_enqueue_calls(self) -> None:
        """2-3 separate ``enqueue()`` calls in one transaction, channels in a random order
        (half the time all bounded ones, whose enqueues take a lock per channel)."""
        rng = self.rng
        bounded = [n for n in self.channels if n.startswith("b")]
        pool = bounded if len(bounded) >= 2 and rng.random() < 0.5 else self.channels
        names = rng.sample(pool, rng.randint(2, min(3, len(pool))))
        pause = rng.choice((0.0, 0.0, 0.002, 0.01))
        self.enqueue_calls(names, rollback=rng.random() < 0.2, pause=pause)

    def op_new_channel(self) -> None:
        self.new_channels += 1
        name = f"new-{self.number}-{self.new_channels}"
        self.enqueue_calls([name], rollback=False, pause=0)
        if self.rng.random() < 0.5:
            self.channels.append(name)  # in this client's mix from now on

    def op_load(self) -> None:
        from django_fairqueue.models import Channel

        channel = Channel.objects.filter(name=self.channel()).first()
        if channel is not None:
            self.loaded.append((time.monotonic(), channel))
            del self.loaded[:-8]

    def op_edit_stale_save(self) -> None:
        """A full ``save()`` of an instance loaded at least a second ago (a stale form)."""
        old = [c for t, c in self.loaded if time.monotonic() - t > 1.0]
        if not old:
            self.outcomes["stale_save_nothing_loaded"] += 1
            return
        channel = self.rng.choice(old)
        for field, value in self.limits(channel.name).items():
            setattr(channel, field, value)
        with transaction.atomic():  # as the admin's change view runs it
            channel.save()
            self.edited([channel.name], "stale_save")

    def op_edit_update_fields(self) -> None:
        from django_fairqueue.models import Channel

        channel = Channel.objects.filter(name=self.channel()).first()
        if channel is None:
            return
        limits = self.limits(channel.name)
        fields = self.rng.sample(sorted(limits), self.rng.randint(1, len(limits)))
        for field in fields:
            setattr(channel, field, limits[field])
        try:
            with transaction.atomic():
                channel.save(update_fields=fields)
                self.edited([channel.name], "update_fields")
        except DatabaseError as exc:
            # Another client deleted the channel after it was read: Django refuses to save a
            # row that is gone, which is right (a later enqueue creates the channel anew).
            if "did not affect any rows" not in str(exc):
                raise

    def op_edit_queryset_update(self) -> None:
        from django_fairqueue.models import Channel

        names = self.rng.sample(self.channels, self.rng.randint(1, 3))
        bounded = any(n.startswith("b") for n in names)
        with transaction.atomic():
            Channel.objects.filter(name__in=names).update(**self.limits("b" if bounded else ""))
            self.edited(names, "queryset_update")

    def op_edit_bulk_update(self) -> None:
        from django_fairqueue.models import Channel

        names = self.rng.sample(self.channels, self.rng.randint(1, 4))
        channels = list(Channel.objects.filter(name__in=names))
        for channel in channels:
            for field, value in self.limits(channel.name).items():
                setattr(channel, field, value)
        with transaction.atomic():
            Channel.objects.bulk_update(
                channels, ["max_concurrency", "weight", "release_interval", "max_backlog"]
            )
            self.edited([c.name for c in channels], "bulk_update")

    def op_pause(self) -> None:
        from django_fairqueue.models import Channel

        # What the admin's "Pause selected channels" action runs.
        Channel.objects.filter(name=self.channel(), paused=False).update(paused=True)

    def op_resume(self) -> None:
        from django_fairqueue.models import Channel

        Channel.objects.filter(name=self.channel(), paused=True).update(paused=False)

    def op_cancel(self) -> None:
        from django_fairqueue.db import message_store
        from django_fairqueue.models import Message

        ids = list(
            Message.objects.filter(state__in=["ready", "scheduled"])
            .order_by("-id")
            .values_list("id", flat=True)[:40]
        )
        chosen = self.rng.sample(ids, min(len(ids), self.rng.randint(1, 4)))
        # What the admin's "Cancel selected waiting messages" action runs.
        self.outcomes["cancelled"] += len(message_store.cancel_messages(chosen))

    def op_enqueue_unique(self) -> None:
        """Unique jobs: a few keys per channel, every scope and policy, alone or in a batch
        with plain messages (never rolled back: a kept id is its holder's, committed)."""
        from django_fairqueue import enqueue_many

        rng = self.rng
        requests = []
        for _ in range(rng.randint(1, 4)):
            name = self.channel()
            request = self.request(name)
            requests.append(
                type(request)(
                    request.task,
                    kwargs=request.kwargs,
                    channel=name,
                    run_after=request.run_after,
                    priority=request.priority,
                    unique_key=f"key-{rng.randint(1, 3)}",
                    unique_scope=rng.choice(("queued", "active")),
                    on_conflict=rng.choice(("keep", "keep", "replace", "raise")),
                )
            )
            if rng.random() < 0.3:
                requests.append(self.request(name))
        with transaction.atomic():
            ids = enqueue_many(requests)
            self.note(ids, [r.channel for r in requests])
        self.enqueued += len(set(ids))

    def op_cancel_matching(self) -> None:
        """Cancel every waiting message of a channel (of one task, sometimes)."""
        from django_fairqueue import cancel
        from tests import stresstasks

        task = stresstasks.kept if self.rng.random() < 0.3 else None
        self.outcomes["cancelled"] += len(cancel(channel=self.channel(), task=task))

    def op_abort(self) -> None:
        """Abort a few recent messages, running or waiting (what the admin's action runs)."""
        from django_fairqueue import abort
        from django_fairqueue.models import Message

        ids = list(
            Message.objects.filter(state__in=["ready", "scheduled", "running"])
            .order_by("-id")
            .values_list("id", flat=True)[:40]
        )
        chosen = self.rng.sample(ids, min(len(ids), self.rng.randint(1, 3)))
        for what in abort(chosen).values():
            self.outcomes[f"abort_{what}"] += 1

    def op_retry_failed(self) -> None:
        from django_fairqueue import failures

        if self.rng.random() < 0.3:
            self.outcomes["retried"] += failures.retry_all(channel=self.channel())
            return
        failed = failures.list_failed(limit=50)
        chosen = self.rng.sample(failed, min(len(failed), self.rng.randint(1, 5)))
        self.outcomes["retried"] += len(failures.retry([f.id for f in chosen]))

    def op_delete_failed(self) -> None:
        from django_fairqueue import failures

        failed = failures.list_failed(limit=50)
        chosen = self.rng.sample(failed, min(len(failed), self.rng.randint(1, 3)))
        self.outcomes["dead_letters_deleted"] += len(failures.delete([f.id for f in chosen]))

    def op_purge(self) -> None:
        from django_fairqueue.db import message_store
        from django_fairqueue.models import Channel

        pk = Channel.objects.filter(name=self.channel()).values_list("pk", flat=True).first()
        if pk is not None:
            # What the admin's "Purge backlog" action runs.
            self.outcomes["purged"] += message_store.purge_channel_backlog(pk)

    def op_delete_channel(self) -> None:
        from django_fairqueue.models import Channel

        name = self.channel()
        _, deleted = Channel.objects.filter(name=name).delete()
        self.outcomes["channels_deleted"] += deleted.get("fairqueue.Channel", 0)
        self.outcomes["messages_deleted_with_channel"] += deleted.get("fairqueue.Message", 0)
        if self.rng.random() < 0.5:
            self.enqueue_calls([name], rollback=False, pause=0)  # and use the name again

    # -- loop ------------------------------------------------------------------------------

    def operations(self) -> list[tuple[float, Callable[[], None]]]:
        return [
            (26, self.op_enqueue_one),
            (14, self.op_enqueue_many),
            (16, self.op_enqueue_calls),
            (3, self.op_new_channel),
            (5, self.op_load),
            (4, self.op_edit_stale_save),
            (3, self.op_edit_update_fields),
            (3, self.op_edit_queryset_update),
            (2, self.op_edit_bulk_update),
            (2, self.op_pause),
            (3, self.op_resume),
            (3, self.op_cancel),
            (6, self.op_enqueue_unique),
            (1, self.op_cancel_matching),
            (2, self.op_abort),
            (3, self.op_retry_failed),
            (1, self.op_delete_failed),
            (1, self.op_purge),
            (1.5, self.op_delete_channel),
        ]

    def run(self, seconds: float, skip: Sequence[str] = ()) -> None:
        from django.db import connection

        from django_fairqueue.exceptions import ChannelFull, DuplicateJob

        ops = [(w, op) for w, op in self.operations() if op.__name__[3:] not in skip]
        weights = [w for w, _ in ops]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            (_, op) = self.rng.choices(ops, weights=weights)[0]
            kind = op.__name__.removeprefix("op_")
            self.ops[kind] += 1
            try:
                op()
            except ChannelFull:
                self.outcomes["channel_full"] += 1
            except DuplicateJob:
                self.outcomes["duplicate_job_refused"] += 1
            except Exception as exc:
                if ChannelFull.from_error(exc) is not None:
                    # the exact bound, checked when a transaction of several calls commits
                    self.outcomes["channel_full_at_commit"] += 1
                else:
                    self.errors.append(describe(kind, exc))
                    if connection.in_atomic_block:  # never: every atomic block above is closed
                        raise
                    connection.close()  # a fresh connection for the next operation
            time.sleep(self.rng.uniform(0.002, 0.02))

    def report(self) -> dict[str, Any]:
        return {
            "client": self.number,
            "ops": dict(self.ops),
            "outcomes": dict(self.outcomes),
            "enqueued": self.enqueued,
            "rolled_back_ids": self.rolled_back_ids,
            "errors": self.errors,
        }


def describe(kind: str, exc: BaseException) -> dict[str, str]:
    """An error's type, text (with PostgreSQL's detail, which names a deadlock's cycle) and
    traceback."""
    text = str(exc)
    cause: BaseException | None = exc
    while cause is not None:
        diag = getattr(cause, "diag", None)
        detail = getattr(diag, "message_detail", None) if diag is not None else None
        sqlstate = getattr(cause, "sqlstate", None)
        if detail and detail not in text:
            text += f"\nDETAIL: {detail}"
        if sqlstate:
            text += f"\nSQLSTATE: {sqlstate}"
            break
        cause = cause.__cause__
    return {
        "op": kind,
        "type": type(exc).__name__,
        "text": text,
        "traceback": "".join(traceback.format_exception(exc))[-3000:],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", required=True)
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--channels", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip", default="", help="operation kinds left out of the mix")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()

    client = Client(f"{args.seed}-{args.client}", args.client, args.channels.split(","))
    try:
        client.run(args.seconds, skip=[k for k in args.skip.split(",") if k])
    finally:
        with open(args.out, "w") as out:
            json.dump(client.report(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
