"""Queues: named pools of work, orthogonal to channels (docs/howto/queues.md).

* ``Channel.queue`` and ``ChannelGroup.queue``, ``'default'`` for every existing row, kept to
  the row's name by the triggers ``fairqueue_channel_queue`` and ``fairqueue_group_queue``.
* The four indexes the claim walks lead with the queue.
* ``fairqueue_claim_v1`` takes ``p_queues`` and ``fairqueue_claim_grouped_v1`` ``p_queue``:
  the previous signatures are dropped first; the families this migration changed are
  installed. Reversing drops the new ones.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

CLAIMABLE = """ready_count > 0 AND NOT paused
  AND (max_concurrency IS NULL OR running_count < max_concurrency)"""
GROUP_CLAIMABLE = """claimable > 0
  AND (max_concurrency IS NULL OR running_count < max_concurrency)"""


def _indexes(lead: str) -> str:
    return f"""
DROP INDEX IF EXISTS fq_channel_turn_idx;
DROP INDEX IF EXISTS fq_channel_vtime_idx;
DROP INDEX IF EXISTS fq_group_turn_idx;
DROP INDEX IF EXISTS fq_group_vtime_idx;
CREATE INDEX fq_channel_turn_idx ON fairqueue_channel ({lead}next_turn_at, id)
WHERE {CLAIMABLE} AND group_id IS NULL;
CREATE INDEX fq_channel_vtime_idx ON fairqueue_channel ({lead}vtime, id)
WHERE {CLAIMABLE} AND group_id IS NULL;
CREATE INDEX fq_group_turn_idx ON fairqueue_channel_group ({lead}next_turn_at, id)
WHERE {GROUP_CLAIMABLE};
CREATE INDEX fq_group_vtime_idx ON fairqueue_channel_group ({lead}vtime, id)
WHERE {GROUP_CLAIMABLE};
"""


DROP_OLD = """
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean, integer, boolean);
DROP FUNCTION IF EXISTS fairqueue_claim_grouped_v1(integer, interval, text, bigint[], bigint[],
    integer, integer, boolean, timestamptz);
"""

DROP_NEW = """
DROP TRIGGER IF EXISTS fairqueue_channel_queue ON fairqueue_channel;
DROP TRIGGER IF EXISTS fairqueue_group_queue ON fairqueue_channel_group;
DROP FUNCTION IF EXISTS fairqueue_set_queue_v1();
DROP FUNCTION IF EXISTS fairqueue_claimable_queues_v1(text[]);
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean, integer, boolean, text[]);
DROP FUNCTION IF EXISTS fairqueue_claim_grouped_v1(integer, interval, text, bigint[], bigint[],
    integer, integer, boolean, timestamptz, text);
DROP FUNCTION IF EXISTS fairqueue_queue_of_name_v1(text);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0023_names_and_priorities_hold")]

    operations = [
        migrations.AddField(
            model_name="channel",
            name="queue",
            field=models.CharField(
                db_default="default", default="default", editable=False, max_length=64
            ),
        ),
        migrations.AddField(
            model_name="channelgroup",
            name="queue",
            field=models.CharField(
                db_default="default", default="default", editable=False, max_length=64
            ),
        ),
        migrations.RunSQL(_indexes("queue, "), _indexes("")),
        # Backwards: the new functions go.
        migrations.RunSQL(DROP_OLD, DROP_NEW),
        InstallFunctions("locks_clocks", "queues", "claim"),
    ]
