"""Channel groups: fairness across groups first, then across the channels of a group.

* ``fairqueue_channel_group`` maps what operators edit; its scheduler state shares the row
  but is not mapped.
* ``fairqueue_channel.group_id`` (``Channel.group``), and the claim's indexes for grouped
  channels and for groups.
* The families this migration changed are installed; no signature changes.
"""

import datetime

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

CLAIMABLE = """ready_count > 0 AND NOT paused
  AND (max_concurrency IS NULL OR running_count < max_concurrency)"""

SCHEMA = f"""
ALTER TABLE fairqueue_channel_group
    ADD COLUMN ready_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN running_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN claimable integer NOT NULL DEFAULT 0,
    ADD COLUMN next_turn_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN turn_used integer NOT NULL DEFAULT 0,
    ADD COLUMN vtime double precision NOT NULL DEFAULT 0,
    ADD COLUMN last_claimed_at timestamptz;
CREATE INDEX fq_group_turn_idx ON fairqueue_channel_group (next_turn_at, id)
WHERE claimable > 0 AND (max_concurrency IS NULL OR running_count < max_concurrency);
CREATE INDEX fq_group_vtime_idx ON fairqueue_channel_group (vtime, id)
WHERE claimable > 0 AND (max_concurrency IS NULL OR running_count < max_concurrency);
CREATE INDEX fq_group_vtime_max_idx ON fairqueue_channel_group (vtime) WHERE vtime > 0;

DROP INDEX fq_channel_turn_idx;
DROP INDEX fq_channel_vtime_idx;
DROP INDEX fq_channel_vtime_max_idx;
CREATE INDEX fq_channel_turn_idx ON fairqueue_channel (next_turn_at, id)
WHERE {CLAIMABLE} AND group_id IS NULL;
CREATE INDEX fq_channel_vtime_idx ON fairqueue_channel (vtime, id)
WHERE {CLAIMABLE} AND group_id IS NULL;
CREATE INDEX fq_channel_vtime_max_idx ON fairqueue_channel (vtime)
WHERE vtime > 0 AND group_id IS NULL;
CREATE INDEX fq_channel_in_group_turn_idx ON fairqueue_channel (group_id, next_turn_at, id)
WHERE group_id IS NOT NULL AND {CLAIMABLE};
CREATE INDEX fq_channel_in_group_vtime_idx ON fairqueue_channel (group_id, vtime, id)
WHERE group_id IS NOT NULL AND {CLAIMABLE};
CREATE INDEX fq_channel_group_idx ON fairqueue_channel (group_id, vtime)
WHERE group_id IS NOT NULL;
"""

UNSCHEMA = f"""
DROP INDEX IF EXISTS fq_channel_group_idx;
DROP INDEX IF EXISTS fq_channel_in_group_vtime_idx;
DROP INDEX IF EXISTS fq_channel_in_group_turn_idx;
DROP INDEX IF EXISTS fq_channel_vtime_max_idx;
DROP INDEX IF EXISTS fq_channel_vtime_idx;
DROP INDEX IF EXISTS fq_channel_turn_idx;
CREATE INDEX fq_channel_turn_idx ON fairqueue_channel (next_turn_at, id)
WHERE {CLAIMABLE};
CREATE INDEX fq_channel_vtime_idx ON fairqueue_channel (vtime, id)
WHERE {CLAIMABLE};
CREATE INDEX fq_channel_vtime_max_idx ON fairqueue_channel (vtime) WHERE vtime > 0;
"""

DROP_NEW = """
DROP TRIGGER IF EXISTS fairqueue_channel_join_group ON fairqueue_channel;
DROP TRIGGER IF EXISTS fairqueue_group_counters ON fairqueue_channel;
DROP TRIGGER IF EXISTS fairqueue_group_counters_delete ON fairqueue_channel;
DROP TRIGGER IF EXISTS fairqueue_group_attach ON fairqueue_channel_group;
DROP FUNCTION IF EXISTS fairqueue_channel_join_group_v1();
DROP FUNCTION IF EXISTS fairqueue_group_attach_v1();
DROP FUNCTION IF EXISTS fairqueue_group_counters_v1();
DROP FUNCTION IF EXISTS fairqueue_ensure_groups_v1(text[]);
DROP FUNCTION IF EXISTS fairqueue_claim_grouped_v1(integer, interval, text, bigint[], bigint[],
    integer, integer, boolean, timestamptz);
DROP FUNCTION IF EXISTS fairqueue_virtual_time_v1(bigint);
DROP FUNCTION IF EXISTS fairqueue_top_virtual_time_v1(bigint, bigint);
DROP FUNCTION IF EXISTS fairqueue_group_virtual_time_v1(bigint, bigint);
DROP FUNCTION IF EXISTS fairqueue_group_of_name_v1(text);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0016_admin_speed")]

    operations = [
        migrations.CreateModel(
            name="ChannelGroup",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(help_text="Channels named <group>/<anything> belong to this group.", max_length=100)),
                ("weight", models.PositiveSmallIntegerField(default=1, help_text="Share of the workers while backlogged, against other groups and ungrouped channels: weight 2 gets twice weight 1.")),
                ("max_concurrency", models.PositiveIntegerField(blank=True, help_text="Most messages of all this group's channels running at once, fleet-wide. Empty: no limit.", null=True)),
                ("release_interval", models.DurationField(default=datetime.timedelta(0), help_text="Minimum time between two releases of this group's channels together (rate limit). 0: no limit.")),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now, editable=False)),
            ],
            options={
                "verbose_name": "channel group",
                "db_table": "fairqueue_channel_group",
                "ordering": ["name"],
                "constraints": [
                    models.UniqueConstraint(fields=("name",), name="fq_group_name_uniq"),
                    models.CheckConstraint(condition=models.Q(("name__regex", "^[^/\\s]([^/]*[^/\\s])?$")), name="fq_group_name_valid"),
                    models.CheckConstraint(condition=models.Q(("max_concurrency__isnull", True), models.Q(("max_concurrency__gte", 1), ("max_concurrency__lte", 1000000)), _connector="OR"), name="fq_group_max_concurrency_range"),
                    models.CheckConstraint(condition=models.Q(("release_interval__gte", datetime.timedelta(0)), ("release_interval__lte", datetime.timedelta(days=1))), name="fq_group_release_interval_range"),
                    models.CheckConstraint(condition=models.Q(("weight__gte", 1), ("weight__lte", 1000)), name="fq_group_weight_range"),
                ],
            },
        ),
        migrations.AddField(
            model_name="channel",
            name="group",
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, editable=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="channels", to="fairqueue.channelgroup"),
        ),
        # the group's columns go with the table when CreateModel is reversed
        migrations.RunSQL(SCHEMA, UNSCHEMA),
        # Backwards: the new functions go.
        migrations.RunSQL(migrations.RunSQL.noop, DROP_NEW),
        InstallFunctions("locks_clocks", "groups", "fold_counters", "claim", "settle"),
    ]
