"""A unique job of scope ``active`` keeps its key while it runs without costing the claim.

* ``fq_message_unique_idx`` now covers waiting messages only (ready, scheduled).
* ``fairqueue_unique_hold`` (``UniqueHold``) holds the key of a message of scope ``active``
  while it waits or runs; filled here from such messages.
* The ``enqueue`` and ``unique_holds`` families are installed (``fairqueue_unique_holder_v1``
  and ``fairqueue_unique_rejoin_v1`` are new; reversing drops them).

Not atomic, so nothing is blocked while the new index builds ``CONCURRENTLY`` under a temporary
name; the hold rows are filled and the functions installed in one transaction; the old index is
dropped ``CONCURRENTLY`` and the new one takes its name.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

WAITING = "WHERE (\"state\" IN ('ready', 'scheduled') AND \"unique_key\" IS NOT NULL)"
WAITING_OR_ACTIVE = (
    "WHERE (\"unique_key\" IS NOT NULL AND (\"state\" IN ('ready', 'scheduled') "
    "OR (\"state\" = 'running' AND \"unique_scope\" = 'active')))"
)


def _build(name: str, predicate: str) -> str:
    return (
        f'CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS "{name}" '
        f'ON "fairqueue_message" ("channel_id", "unique_key") {predicate}'
    )


FILL_HOLDS = """
INSERT INTO fairqueue_unique_hold (channel_id, unique_key, message_id)
SELECT m.channel_id, m.unique_key, m.id
FROM fairqueue_message m
WHERE m.unique_key IS NOT NULL AND m.unique_scope = 'active'
  AND m.state IN ('ready', 'scheduled', 'running')
ON CONFLICT (channel_id, unique_key) DO NOTHING;
"""

DROP_NEW_FUNCTIONS = """
DROP FUNCTION IF EXISTS fairqueue_unique_rejoin_v1(bigint, text, bigint, text);
DROP FUNCTION IF EXISTS fairqueue_unique_holder_v1(bigint, text, bigint, text);
"""


def _swap(old: str) -> tuple[str, ...]:
    """Drop the index named fq_message_unique_idx and give its name to ``old``'s."""
    return (
        'DROP INDEX CONCURRENTLY IF EXISTS "fq_message_unique_idx"',
        f'ALTER INDEX "{old}" RENAME TO "fq_message_unique_idx"',
    )


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("fairqueue", "0021_wake_up_without_reading_the_head")]

    operations = [
        migrations.CreateModel(
            name="UniqueHold",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "channel_id",
                        "unique_key",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("channel_id", models.BigIntegerField()),
                ("unique_key", models.CharField(max_length=200)),
                ("message_id", models.BigIntegerField()),
            ],
            options={"db_table": "fairqueue_unique_hold"},
        ),
        migrations.RunSQL(
            _build("fq_message_unique_waiting", WAITING),
            'DROP INDEX CONCURRENTLY IF EXISTS "fq_message_unique_waiting"',
        ),
        # One transaction: the hold rows and the functions that keep them.
        migrations.RunSQL(migrations.RunSQL.noop, DROP_NEW_FUNCTIONS),
        InstallFunctions("unique_holds", "enqueue", first=FILL_HOLDS),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    _swap("fq_message_unique_waiting"),
                    (
                        _build("fq_message_unique_waiting", WAITING_OR_ACTIVE),
                        *_swap("fq_message_unique_waiting"),
                    ),
                ),
            ],
            state_operations=[
                migrations.RemoveConstraint(model_name="message", name="fq_message_unique_idx"),
                migrations.AddConstraint(
                    model_name="message",
                    constraint=models.UniqueConstraint(
                        models.F("channel"),
                        models.F("unique_key"),
                        condition=models.Q(
                            ("state__in", ("ready", "scheduled")), ("unique_key__isnull", False)
                        ),
                        name="fq_message_unique_idx",
                    ),
                ),
            ],
        ),
    ]
