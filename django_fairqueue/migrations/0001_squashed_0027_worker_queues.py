"""The schema and server functions as migrations 0001-0027 left them, in one migration.

A new database runs this one only; one that ran some of 0001-0027 runs the rest of them (see
``replaces``), then Django records this one as applied. Both end with the same schema and
functions (tests/test_migrations.py). The models own the DDL of what they map; created here in
SQL: the scheduler's state in the channel and group rows (written by the server functions
only) and the claim's indexes over it, a schedule's firing state, the compact forms of the
message table's CHECK constraints, the storage parameters of the busy tables, and
``fairqueue_pipeline_job`` (its model is the pipeline app's, whose first migration takes the
table over). Then every family of server functions is installed from ``db/functions/``.
"""

import datetime

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

import django_fairqueue.models
from django_fairqueue.db.functions import FAMILIES
from django_fairqueue.migrations._sql import DROP_ALL_FUNCTIONS, InstallFunctions

CLAIMABLE = """ready_count > 0 AND NOT paused
  AND (max_concurrency IS NULL OR running_count < max_concurrency)"""
GROUP_CLAIMABLE = """claimable > 0
  AND (max_concurrency IS NULL OR running_count < max_concurrency)"""

# Busy tables: vacuumed after a fixed number of dead rows, unthrottled (docs/reliability.md).
STORAGE = """
ALTER TABLE fairqueue_channel SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.05
);
ALTER TABLE fairqueue_channel_delta SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE fairqueue_message SET (
    fillfactor = 90,
    autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE fairqueue_work_batch SET (
    autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0
);
"""

# The scheduler's state and the claim's walks over it. A new channel joins the round at the back.
SCHEDULER_STATE = f"""
ALTER TABLE fairqueue_channel
    ADD COLUMN next_turn_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ADD COLUMN turn_used integer NOT NULL DEFAULT 0 CHECK (turn_used >= 0),
    ADD COLUMN ready_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN scheduled_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN running_count integer NOT NULL DEFAULT 0,
    ADD COLUMN failed_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN succeeded_total bigint NOT NULL DEFAULT 0,
    ADD COLUMN last_claimed_at timestamptz,
    ADD COLUMN batch_pending boolean NOT NULL DEFAULT false,
    ADD COLUMN batch_turn_at timestamptz NOT NULL DEFAULT statement_timestamp(),
    ADD COLUMN batch_turn_used integer NOT NULL DEFAULT 0 CHECK (batch_turn_used >= 0),
    ADD COLUMN vtime double precision NOT NULL DEFAULT 0,
    ADD COLUMN mean_run double precision;
ALTER TABLE fairqueue_channel_group
    ADD COLUMN ready_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN running_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN claimable integer NOT NULL DEFAULT 0,
    ADD COLUMN next_turn_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN turn_used integer NOT NULL DEFAULT 0,
    ADD COLUMN vtime double precision NOT NULL DEFAULT 0,
    ADD COLUMN last_claimed_at timestamptz;
CREATE INDEX fq_channel_turn_idx ON fairqueue_channel (queue, next_turn_at, id)
WHERE {CLAIMABLE} AND group_id IS NULL;
CREATE INDEX fq_channel_vtime_idx ON fairqueue_channel (queue, vtime, id)
WHERE {CLAIMABLE} AND group_id IS NULL;
CREATE INDEX fq_channel_vtime_max_idx ON fairqueue_channel (vtime)
WHERE vtime > 0 AND group_id IS NULL;
CREATE INDEX fq_channel_in_group_turn_idx ON fairqueue_channel (group_id, next_turn_at, id)
WHERE group_id IS NOT NULL AND {CLAIMABLE};
CREATE INDEX fq_channel_in_group_vtime_idx ON fairqueue_channel (group_id, vtime, id)
WHERE group_id IS NOT NULL AND {CLAIMABLE};
CREATE INDEX fq_channel_group_idx ON fairqueue_channel (group_id, vtime)
WHERE group_id IS NOT NULL;
CREATE INDEX fq_channel_batch_turn_idx ON fairqueue_channel (batch_turn_at, id)
WHERE batch_pending AND NOT paused;
CREATE INDEX fq_group_turn_idx ON fairqueue_channel_group (queue, next_turn_at, id)
WHERE {GROUP_CLAIMABLE};
CREATE INDEX fq_group_vtime_idx ON fairqueue_channel_group (queue, vtime, id)
WHERE {GROUP_CLAIMABLE};
CREATE INDEX fq_group_vtime_max_idx ON fairqueue_channel_group (vtime) WHERE vtime > 0;
"""

# A schedule's firing state; ``stale``: computed for another spec (the planner keeps its stats).
FIRING_STATE = """
ALTER TABLE fairqueue_schedule
    ADD COLUMN next_fire_at timestamptz,
    ADD COLUMN last_slot_at timestamptz,
    ADD COLUMN last_fired_at timestamptz,
    ADD COLUMN last_message_id bigint,
    ADD COLUMN fired_spec text,
    ADD COLUMN spec text GENERATED ALWAYS AS (
        cron || ' ' || timezone || CASE WHEN enabled THEN ' on' ELSE ' off' END
    ) STORED,
    ADD COLUMN stale boolean GENERATED ALWAYS AS (
        fired_spec IS DISTINCT FROM (
            cron || ' ' || timezone || CASE WHEN enabled THEN ' on' ELSE ' off' END
        )
    ) STORED;
CREATE INDEX fq_schedule_next_idx ON fairqueue_schedule (next_fire_at) WHERE enabled;
CREATE INDEX fq_schedule_stale_idx ON fairqueue_schedule (id) WHERE stale;
"""

#: name -> (compact form, Django's form of the model's constraint, word for word). The compact
#: ones accept the same rows (tests/test_message_checks.py) and cost ~10 us less per statement.
MESSAGE_CHECKS = {
    "fq_message_state_valid": (
        "state::text = ANY "
        "('{scheduled,ready,running,succeeded,failed,cancelled,aborted}'::text[])",
        "state IN ('scheduled', 'ready', 'running', 'succeeded', 'failed', 'cancelled', 'aborted')",
    ),
    "fq_message_lease_iff_running": (
        "(state::text = 'running') = (lease_token IS NOT NULL) "
        "AND (lease_expires_at IS NOT NULL OR state::text <> 'running')",
        "(lease_expires_at IS NOT NULL AND lease_token IS NOT NULL AND state = 'running') "
        "OR (NOT (state = 'running') AND lease_token IS NULL)",
    ),
    "fq_message_task_name": (
        "task_name::text <> ''",
        "NOT (task_name = '')",
    ),
    "fq_message_unique_scope": (
        "(unique_key IS NOT NULL OR unique_scope IS NULL) "
        "AND unique_scope::text = ANY ('{queued,active}'::text[])",
        "(unique_key IS NULL AND unique_scope IS NULL) "
        "OR (unique_key IS NOT NULL AND unique_scope IN ('queued', 'active'))",
    ),
}

COMPACT_CHECKS = "ALTER TABLE fairqueue_message\n    " + ",\n    ".join(
    f"DROP CONSTRAINT {name}, ADD CONSTRAINT {name} CHECK ({compact})"
    for name, (compact, _django) in MESSAGE_CHECKS.items()
) + ";"


class Migration(migrations.Migration):

    replaces = [
        ('fairqueue', '0001_initial'),
        ('fairqueue', '0002_functions_v1'),
        ('fairqueue', '0003_work_batch_claim'),
        ('fairqueue', '0004_claim_wait'),
        ('fairqueue', '0005_maintenance_probes'),
        ('fairqueue', '0006_channel_state_outside_the_model'),
        ('fairqueue', '0007_worker_registry'),
        ('fairqueue', '0009_unique_jobs_and_abort'),
        ('fairqueue', '0010_unique_batches_in_key_order'),
        ('fairqueue', '0011_message_admin_indexes'),
        ('fairqueue', '0012_pipeline_job'),
        ('fairqueue', '0013_fairness_by_time'),
        ('fairqueue', '0014_periodic_schedules'),
        ('fairqueue', '0015_settlements_lock_in_id_order'),
        ('fairqueue', '0016_admin_speed'),
        ('fairqueue', '0017_channel_groups'),
        ('fairqueue', '0018_faster_enqueue'),
        ('fairqueue', '0019_pipeline_job_to_its_app'),
        ('fairqueue', '0020_group_cap_covers_batches'),
        ('fairqueue', '0021_wake_up_without_reading_the_head'),
        ('fairqueue', '0022_unique_active_off_the_claim'),
        ('fairqueue', '0023_names_and_priorities_hold'),
        ('fairqueue', '0024_queues'),
        ('fairqueue', '0025_lift_within_one_charge'),
        ('fairqueue', '0026_claim_every_queue_as_one'),
        ('fairqueue', '0027_worker_queues'),
    ]

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='MinuteStat',
            fields=[
                ('minute', models.DateTimeField(primary_key=True, serialize=False)),
                ('claimed', models.BigIntegerField(default=0)),
                ('succeeded', models.BigIntegerField(default=0)),
                ('failed', models.BigIntegerField(default=0)),
                ('retried', models.BigIntegerField(default=0)),
                ('timed_out', models.BigIntegerField(default=0)),
                ('wait_ms_sum', models.BigIntegerField(default=0)),
                ('wait_ms_max', models.IntegerField(default=0)),
                ('wait_histogram', django_fairqueue.models.IntegerArrayField(default=list)),
                ('run_ms_sum', models.BigIntegerField(default=0)),
            ],
            options={
                'db_table': 'fairqueue_minute_stat',
            },
        ),
        migrations.CreateModel(
            name='UniqueHold',
            fields=[
                ('pk', models.CompositePrimaryKey('channel_id', 'unique_key', blank=True, editable=False, primary_key=True, serialize=False)),
                ('channel_id', models.BigIntegerField()),
                ('unique_key', models.CharField(max_length=200)),
                ('message_id', models.BigIntegerField()),
            ],
            options={
                'db_table': 'fairqueue_unique_hold',
            },
        ),
        migrations.CreateModel(
            name='ChannelGroup',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(help_text='Channels named <group>/<anything> belong to this group.', max_length=100)),
                ('weight', models.PositiveSmallIntegerField(default=1, help_text='Share of the workers while backlogged, against other groups and ungrouped channels: weight 2 gets twice weight 1.')),
                ('max_concurrency', models.PositiveIntegerField(blank=True, help_text="Most messages of all this group's channels running at once, fleet-wide. Empty: no limit.", null=True)),
                ('release_interval', models.DurationField(default=datetime.timedelta(0), help_text="Minimum time between two releases of this group's channels together (rate limit). 0: no limit.")),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ('queue', models.CharField(db_default='default', default='default', editable=False, max_length=64)),
            ],
            options={
                'verbose_name': 'channel group',
                'db_table': 'fairqueue_channel_group',
                'ordering': ['name'],
                'constraints': [models.UniqueConstraint(fields=('name',), name='fq_group_name_uniq'), models.CheckConstraint(condition=models.Q(('name__regex', '^[^/\\s]([^/]*[^/\\s])?$')), name='fq_group_name_valid'), models.CheckConstraint(condition=models.Q(('max_concurrency__isnull', True), models.Q(('max_concurrency__gte', 1), ('max_concurrency__lte', 1000000)), _connector='OR'), name='fq_group_max_concurrency_range'), models.CheckConstraint(condition=models.Q(('release_interval__gte', datetime.timedelta(0)), ('release_interval__lte', datetime.timedelta(days=1))), name='fq_group_release_interval_range'), models.CheckConstraint(condition=models.Q(('weight__gte', 1), ('weight__lte', 1000)), name='fq_group_weight_range')],
            },
        ),
        migrations.CreateModel(
            name='Channel',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=200)),
                ('max_concurrency', models.PositiveIntegerField(blank=True, help_text='Most messages of this channel running at once, fleet-wide. Empty: no limit.', null=True)),
                ('release_interval', models.DurationField(default=datetime.timedelta(0), help_text='Minimum time between two releases (rate limit). 0: no limit.')),
                ('weight', models.PositiveSmallIntegerField(default=1, help_text='Share of the workers while backlogged: weight 2 gets twice weight 1.')),
                ('paused', models.BooleanField(default=False)),
                ('max_backlog', models.PositiveIntegerField(blank=True, help_text='Most messages waiting (ready + scheduled). Enqueue past it fails. Empty: no limit.', null=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ('queue', models.CharField(db_default='default', default='default', editable=False, max_length=64)),
                ('group', models.ForeignKey(blank=True, db_constraint=False, db_index=False, editable=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='channels', to='fairqueue.channelgroup')),
            ],
            options={
                'db_table': 'fairqueue_channel',
                'ordering': ['name'],
                'constraints': [models.UniqueConstraint(fields=('name',), name='fq_channel_name_uniq'), models.CheckConstraint(condition=models.Q(('name__regex', '^\\S'), ('name__regex', '\\S$')), name='fq_channel_name_trimmed'), models.CheckConstraint(condition=models.Q(('max_concurrency__isnull', True), models.Q(('max_concurrency__gte', 1), ('max_concurrency__lte', 1000000)), _connector='OR'), name='fq_channel_max_concurrency_range'), models.CheckConstraint(condition=models.Q(('release_interval__gte', datetime.timedelta(0)), ('release_interval__lte', datetime.timedelta(days=1))), name='fq_channel_release_interval_range'), models.CheckConstraint(condition=models.Q(('weight__gte', 1), ('weight__lte', 1000)), name='fq_channel_weight_range'), models.CheckConstraint(condition=models.Q(('max_backlog__isnull', True), ('max_backlog__gte', 1), _connector='OR'), name='fq_channel_max_backlog_positive')],
            },
        ),
        migrations.CreateModel(
            name='ChannelStat',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('minute', models.DateTimeField()),
                ('claimed', models.IntegerField(default=0)),
                ('succeeded', models.IntegerField(default=0)),
                ('failed', models.IntegerField(default=0)),
                ('retried', models.IntegerField(default=0)),
                ('wait_ms_sum', models.BigIntegerField(default=0)),
                ('wait_ms_max', models.IntegerField(default=0)),
                ('wait_histogram', django_fairqueue.models.IntegerArrayField(default=list)),
                ('run_ms_sum', models.BigIntegerField(default=0)),
                ('timed_out', models.IntegerField(db_default=0, default=0)),
                ('channel', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='fairqueue.channel')),
            ],
            options={
                'db_table': 'fairqueue_channel_stat',
                'indexes': [models.Index(models.F('minute'), name='fq_stat_minute_idx')],
                'constraints': [models.UniqueConstraint(fields=('channel', 'minute'), name='fq_stat_channel_minute')],
            },
        ),
        migrations.CreateModel(
            name='Message',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task_name', models.CharField(max_length=200)),
                ('payload', models.JSONField(default=dict)),
                ('priority', models.SmallIntegerField(default=0)),
                ('state', models.CharField(choices=[('scheduled', 'scheduled'), ('ready', 'ready'), ('running', 'running'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('cancelled', 'cancelled'), ('aborted', 'aborted')], max_length=16)),
                ('run_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('enqueued_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('max_attempts', models.PositiveIntegerField(default=1)),
                ('keep_result', models.BooleanField(default=False)),
                ('lease_token', models.UUIDField(blank=True, null=True)),
                ('lease_expires_at', models.DateTimeField(blank=True, null=True)),
                ('claimed_at', models.DateTimeField(blank=True, null=True)),
                ('worker_id', models.CharField(blank=True, default='', max_length=200)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('result', models.JSONField(blank=True, null=True)),
                ('last_error', models.JSONField(blank=True, null=True)),
                ('abort_requested_at', models.DateTimeField(blank=True, null=True)),
                ('unique_key', models.CharField(blank=True, max_length=200, null=True)),
                ('unique_scope', models.CharField(blank=True, choices=[('queued', 'while queued'), ('active', 'while queued or running')], max_length=8, null=True)),
                ('channel', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='messages', to='fairqueue.channel')),
            ],
            options={
                'db_table': 'fairqueue_message',
                'ordering': ['id'],
                'indexes': [models.Index(models.F('channel'), models.OrderBy(models.F('priority'), descending=True), models.F('id'), condition=models.Q(('state', 'ready')), name='fq_message_ready_idx'), models.Index(models.F('run_at'), models.F('id'), condition=models.Q(('state', 'scheduled')), name='fq_message_due_idx'), models.Index(models.F('lease_expires_at'), condition=models.Q(('state', 'running')), name='fq_message_lease_idx'), models.Index(models.F('channel'), models.F('id'), condition=models.Q(('state', 'failed')), name='fq_message_failed_idx'), models.Index(models.F('channel'), models.F('run_at'), condition=models.Q(('state', 'scheduled')), name='fq_message_sched_chan_idx'), models.Index(models.F('finished_at'), condition=models.Q(('state__in', ['succeeded', 'cancelled', 'aborted'])), name='fq_message_finished_idx'), models.Index(models.F('channel'), models.F('id'), name='fq_message_channel_idx'), models.Index(models.F('state'), models.F('id'), name='fq_message_state_idx'), models.Index(models.F('channel'), condition=models.Q(('attempts__gt', 0), ('state', 'scheduled')), name='fq_message_retrying_idx')],
                'constraints': [models.CheckConstraint(condition=models.Q(('max_attempts__gte', 1)), name='fq_message_max_attempts_positive'), models.CheckConstraint(condition=models.Q(models.Q(('lease_expires_at__isnull', False), ('lease_token__isnull', False), ('state', 'running')), models.Q(models.Q(('state', 'running'), _negated=True), ('lease_token__isnull', True)), _connector='OR'), name='fq_message_lease_iff_running'), models.CheckConstraint(condition=models.Q(('task_name', ''), _negated=True), name='fq_message_task_name'), models.CheckConstraint(condition=models.Q(('state__in', ['scheduled', 'ready', 'running', 'succeeded', 'failed', 'cancelled', 'aborted'])), name='fq_message_state_valid'), models.CheckConstraint(condition=models.Q(models.Q(('unique_key__isnull', True), ('unique_scope__isnull', True)), models.Q(('unique_key__isnull', False), ('unique_scope__in', ['queued', 'active'])), _connector='OR'), name='fq_message_unique_scope'), models.UniqueConstraint(models.F('channel'), models.F('unique_key'), condition=models.Q(('state__in', ('ready', 'scheduled')), ('unique_key__isnull', False)), name='fq_message_unique_idx'), models.CheckConstraint(condition=models.Q(('priority__gte', -100), ('priority__lte', 100)), name='fq_message_priority_range')],
            },
        ),
        migrations.CreateModel(
            name='Schedule',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=200)),
                ('task_name', models.CharField(max_length=200)),
                ('args', models.JSONField(blank=True, default=list)),
                ('kwargs', models.JSONField(blank=True, default=dict)),
                ('cron', models.CharField(help_text='Five fields: minute hour day-of-month month day-of-week, or @daily etc.', max_length=200)),
                ('timezone', models.CharField(default='UTC', help_text='IANA name, e.g. Europe/Berlin: the cron is read in this timezone.', max_length=64)),
                ('missed', models.CharField(choices=[('latest', 'run once (the latest missed slot)'), ('skip', 'skip missed slots'), ('catch_up', 'catch up (each missed slot, up to a bound)')], default='latest', help_text='What to do with slots that passed while nothing fired.', max_length=16)),
                ('catch_up_max', models.PositiveSmallIntegerField(default=10, help_text='With catch up: at most this many missed slots are fired.')),
                ('jitter', models.DurationField(default=datetime.timedelta(0), help_text="Delay each slot's message by a fixed fraction of this (0: none).")),
                ('priority', models.SmallIntegerField(blank=True, help_text="Empty: the task's priority.", null=True)),
                ('enabled', models.BooleanField(default=True)),
                ('source', models.CharField(choices=[('code', 'code'), ('admin', 'admin')], default='admin', editable=False, max_length=8)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ('channel', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='schedules', to='fairqueue.channel')),
            ],
            options={
                'db_table': 'fairqueue_schedule',
                'ordering': ['channel__name', 'name'],
                'constraints': [models.UniqueConstraint(fields=('channel', 'name'), name='fq_schedule_channel_name'), models.UniqueConstraint(condition=models.Q(('source', 'code')), fields=('name',), name='fq_schedule_code_name'), models.CheckConstraint(condition=models.Q(('missed__in', ['latest', 'skip', 'catch_up'])), name='fq_schedule_missed_valid'), models.CheckConstraint(condition=models.Q(('catch_up_max__gte', 1), ('catch_up_max__lte', 1000)), name='fq_schedule_catch_up_range'), models.CheckConstraint(condition=models.Q(('jitter__gte', datetime.timedelta(0)), ('jitter__lte', datetime.timedelta(days=1))), name='fq_schedule_jitter_range'), models.CheckConstraint(condition=models.Q(('source__in', ['code', 'admin'])), name='fq_schedule_source_valid'), models.CheckConstraint(condition=models.Q(('task_name', ''), _negated=True), name='fq_schedule_task_name')],
            },
        ),
        migrations.CreateModel(
            name='ScheduleFire',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('slot_at', models.DateTimeField()),
                ('fired_at', models.DateTimeField()),
                ('message_id', models.BigIntegerField(blank=True, null=True)),
                ('schedule', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='fires', to='fairqueue.schedule')),
            ],
            options={
                'db_table': 'fairqueue_schedule_fire',
                'ordering': ['-slot_at'],
                'indexes': [models.Index(models.F('fired_at'), name='fq_fire_fired_idx')],
                'constraints': [models.UniqueConstraint(fields=('schedule', 'slot_at'), name='fq_fire_schedule_slot')],
            },
        ),
        migrations.CreateModel(
            name='WorkBatch',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('job_name', models.CharField(max_length=200)),
                ('start_id', models.BigIntegerField()),
                ('end_id', models.BigIntegerField(help_text='Inclusive.')),
                ('row_count', models.BigIntegerField(default=0, help_text='Rows in the range when planned.')),
                ('state', models.CharField(choices=[('pending', 'pending'), ('running', 'running'), ('succeeded', 'succeeded'), ('failed', 'failed')], default='pending', max_length=16)),
                ('run_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('max_attempts', models.PositiveIntegerField(default=3)),
                ('lease_token', models.UUIDField(blank=True, null=True)),
                ('heartbeat_at', models.DateTimeField(blank=True, null=True)),
                ('lease_expires_at', models.DateTimeField(blank=True, null=True)),
                ('worker_id', models.CharField(blank=True, default='', max_length=200)),
                ('last_error', models.JSONField(blank=True, null=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('started_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('rows_processed', models.BigIntegerField(default=0)),
                ('channel', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='work_batches', to='fairqueue.channel')),
            ],
            options={
                'verbose_name_plural': 'work batches',
                'db_table': 'fairqueue_work_batch',
                'ordering': ['job_name', 'start_id'],
                'indexes': [models.Index(models.F('channel'), models.F('run_at'), models.F('id'), condition=models.Q(('state', 'pending')), name='fq_batch_pending_idx'), models.Index(models.F('lease_expires_at'), condition=models.Q(('state', 'running')), name='fq_batch_lease_idx'), models.Index(models.F('job_name'), models.F('state'), name='fq_batch_job_idx'), models.Index(models.F('channel'), condition=models.Q(('state', 'running')), name='fq_batch_running_idx')],
                'constraints': [models.UniqueConstraint(fields=('job_name', 'start_id'), name='fq_batch_job_start_uniq'), models.CheckConstraint(condition=models.Q(('end_id__gte', models.F('start_id'))), name='fq_batch_range'), models.CheckConstraint(condition=models.Q(('state__in', ['pending', 'running', 'succeeded', 'failed'])), name='fq_batch_state_valid'), models.CheckConstraint(condition=models.Q(('max_attempts__gte', 1)), name='fq_batch_max_attempts_positive'), models.CheckConstraint(condition=models.Q(models.Q(('state', 'running'), ('lease_token__isnull', False)), models.Q(models.Q(('state', 'running'), _negated=True), ('lease_token__isnull', True)), _connector='OR'), name='fq_batch_lease_iff_running')],
            },
        ),
        migrations.CreateModel(
            name='WorkerRecord',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('worker_id', models.CharField(max_length=200, unique=True)),
                ('host', models.CharField(max_length=255)),
                ('pid', models.IntegerField()),
                ('version', models.CharField(max_length=50)),
                ('concurrency', models.IntegerField()),
                ('channels', models.JSONField(default=list)),
                ('exclude_channels', models.JSONField(default=list)),
                ('state', models.CharField(choices=[('running', 'running'), ('stopped', 'stopped'), ('dead', 'dead')], max_length=16)),
                ('started_at', models.DateTimeField()),
                ('heartbeat_at', models.DateTimeField()),
                ('last_claim_at', models.DateTimeField(blank=True, null=True)),
                ('running', models.IntegerField(default=0)),
                ('handled', models.BigIntegerField(default=0)),
                ('stopped_at', models.DateTimeField(blank=True, null=True)),
                ('queues', models.JSONField(blank=True, default=None, null=True)),
            ],
            options={
                'db_table': 'fairqueue_worker',
                'ordering': ['-heartbeat_at'],
                'indexes': [models.Index(models.F('heartbeat_at'), condition=models.Q(('state', 'running')), name='fq_worker_beat_idx')],
                'constraints': [models.CheckConstraint(condition=models.Q(('state__in', ['running', 'stopped', 'dead'])), name='fq_worker_state_valid')],
            },
        ),
        migrations.CreateModel(
            name='ChannelDelta',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('ready', models.IntegerField(db_default=0, default=0)),
                ('scheduled', models.IntegerField(db_default=0, default=0)),
                ('running', models.IntegerField(db_default=0, default=0)),
                ('failed', models.IntegerField(db_default=0, default=0)),
                ('succeeded', models.IntegerField(db_default=0, default=0)),
                ('wake', models.BooleanField(db_default=True, default=True)),
                ('batch_pending', models.BooleanField(db_default=False, default=False)),
                ('backlog_check', models.BooleanField(db_default=False, default=False)),
                ('run_seconds', models.FloatField(db_default=0.0, default=0.0)),
                ('run_count', models.IntegerField(db_default=0, default=0)),
                ('channel', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='fairqueue.channel')),
            ],
            options={
                'db_table': 'fairqueue_channel_delta',
                'indexes': [models.Index(models.F('channel'), name='fq_delta_channel_idx'), models.Index(models.F('id'), condition=models.Q(('wake', True)), name='fq_delta_wake_idx')],
            },
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.CreateModel(
                    name='PipelineJob',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('job_name', models.CharField(max_length=200, unique=True)),
                        ('pipeline', models.CharField(max_length=100)),
                        ('tenant', models.CharField(max_length=200)),
                        ('version', models.CharField(help_text='Content hash of the formula set.', max_length=16)),
                        ('formulas', models.JSONField(blank=True, help_text='The pinned formulas: [name, expression] pairs.', null=True)),
                        ('today', models.DateField(help_text='What TODAY() is for every batch of the job.')),
                        ('errors', models.JSONField(blank=True, default=dict, help_text='Error values written, per rule.')),
                        ('aggregates', models.JSONField(blank=True, help_text='The tenant aggregates its batches use (phase one).', null=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('cancelled_at', models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        'db_table': 'fairqueue_pipeline_job',
                        'ordering': ['job_name'],
                    },
                ),
            ],
        ),
        # the columns, indexes and forms go with the tables when CreateModel is reversed
        migrations.RunSQL(SCHEDULER_STATE, migrations.RunSQL.noop),
        migrations.RunSQL(FIRING_STATE, migrations.RunSQL.noop),
        migrations.RunSQL(COMPACT_CHECKS, migrations.RunSQL.noop),
        migrations.RunSQL(STORAGE, migrations.RunSQL.noop),
        migrations.RunSQL(migrations.RunSQL.noop, DROP_ALL_FUNCTIONS),
        InstallFunctions(*FAMILIES),
    ]
