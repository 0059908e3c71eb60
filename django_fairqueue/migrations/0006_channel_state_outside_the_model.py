"""The scheduler's state leaves the Channel model; deadlock-free enqueue, one cap for both queues.

* The counters and turns of ``fairqueue_channel`` stay in the table but are no longer model
  fields, so no ORM write can write them back; they get database defaults.
* ``fairqueue_channel_delta`` gains ``batch_pending`` and ``backlog_check`` (the max_backlog
  bound is checked when the enqueuing transaction commits).
* ``fairqueue_enqueue_v1`` takes two more arguments (its old signature is dropped first),
  ``fairqueue_enqueue_one_v1`` is new, ``fairqueue_complete_and_claim_v1`` is dropped; the
  families this migration changed are installed.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

SCHEDULER_COLUMNS = [
    "next_turn_at",
    "turn_used",
    "ready_count",
    "scheduled_count",
    "running_count",
    "failed_count",
    "succeeded_total",
    "last_claimed_at",
    "batch_turn_at",
    "batch_turn_used",
    "batch_pending",
]

DEFAULTS = """
ALTER TABLE fairqueue_channel
    -- a new channel joins the round at the back: behind everyone served before it exists
    ALTER COLUMN next_turn_at SET DEFAULT clock_timestamp(),
    ALTER COLUMN turn_used SET DEFAULT 0,
    ALTER COLUMN ready_count SET DEFAULT 0,
    ALTER COLUMN scheduled_count SET DEFAULT 0,
    ALTER COLUMN running_count SET DEFAULT 0,
    ALTER COLUMN failed_count SET DEFAULT 0,
    ALTER COLUMN succeeded_total SET DEFAULT 0;
"""

UNDEFAULTS = """
ALTER TABLE fairqueue_channel
    ALTER COLUMN next_turn_at DROP DEFAULT,
    ALTER COLUMN turn_used DROP DEFAULT,
    ALTER COLUMN ready_count DROP DEFAULT,
    ALTER COLUMN scheduled_count DROP DEFAULT,
    ALTER COLUMN running_count DROP DEFAULT,
    ALTER COLUMN failed_count DROP DEFAULT,
    ALTER COLUMN succeeded_total DROP DEFAULT;
"""

DROP_OLD_ENQUEUE = """
DROP FUNCTION IF EXISTS fairqueue_enqueue_v1(text[], text[], jsonb[], smallint[], timestamptz[],
    integer[], boolean[], integer, interval, integer, integer, text);
-- Completing and claiming in one call is gone: the worker settles in a thread of its own,
-- batching completions across its handlers, and never called it.
DROP FUNCTION IF EXISTS fairqueue_complete_and_claim_v1(bigint[], uuid[], jsonb[], integer,
    interval, text, bigint[], bigint[], integer, integer);
DROP FUNCTION IF EXISTS fairqueue_complete_and_claim_v1(bigint[], uuid[], jsonb[], integer,
    interval, text, bigint[], bigint[], integer);
"""

DROP_NEW = """
DROP TRIGGER IF EXISTS fairqueue_backlog_check ON fairqueue_channel_delta;
DROP FUNCTION IF EXISTS fairqueue_backlog_check_v1();
DROP FUNCTION IF EXISTS fairqueue_check_backlog_v1(bigint[], bigint[], boolean);
DROP FUNCTION IF EXISTS fairqueue_channel_lock_key_v1();
DROP FUNCTION IF EXISTS fairqueue_fold_channel_v1(bigint);
DROP FUNCTION IF EXISTS fairqueue_verify_channels_v1(bigint[]);
DROP FUNCTION IF EXISTS fairqueue_repair_channels_v1(bigint[]);
DROP FUNCTION IF EXISTS fairqueue_verify_orphans_v1();
DROP FUNCTION IF EXISTS fairqueue_repair_orphans_v1();
DROP FUNCTION IF EXISTS fairqueue_enqueue_one_v1(text, text, jsonb, smallint, timestamptz, integer,
    boolean, integer, interval, integer, integer, text, interval, boolean);
DROP FUNCTION IF EXISTS fairqueue_enqueue_v1(text[], text[], jsonb[], smallint[], timestamptz[],
    integer[], boolean[], integer, interval, integer, integer, text, interval[], boolean);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0005_maintenance_probes")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="channel", name="fq_channel_turn_idx"),
                migrations.RemoveIndex(model_name="channel", name="fq_channel_batch_turn_idx"),
                *(
                    migrations.RemoveField(model_name="channel", name=column)
                    for column in SCHEDULER_COLUMNS
                ),
            ],
            database_operations=[migrations.RunSQL(DEFAULTS, UNDEFAULTS)],
        ),
        migrations.AddField(
            model_name="channeldelta",
            name="batch_pending",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddField(
            model_name="channeldelta",
            name="backlog_check",
            field=models.BooleanField(db_default=False, default=False),
        ),
        # Backwards: the new functions go.
        migrations.RunSQL(DROP_OLD_ENQUEUE, DROP_NEW),
        InstallFunctions(
            "locks_clocks",
            "fold_counters",
            "claim",
            "settle",
            "enqueue",
            "backlog",
            "verify_repair",
            "batches",
        ),
    ]
