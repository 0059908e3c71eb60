"""Periodic schedules: the schedule table, its firing state outside the model, and the fires.

``fairqueue_schedule`` maps what operators and code declare; its firing state (``next_fire_at``,
``last_slot_at``, ``last_fired_at``, ``last_message_id``, ``fired_spec`` and the generated
``spec`` and ``stale``) is written only by the firing statements of ``sql/queries.sql``.
``fairqueue_schedule_fire`` holds one row per fired slot, unique on (schedule, slot).
"""

import datetime
import importlib
import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

SQUASHED = importlib.import_module("django_fairqueue.migrations.0001_squashed_0027_worker_queues")


class Migration(migrations.Migration):

    dependencies = [
        ('fairqueue', '0013_fairness_by_time'),
    ]

    operations = [
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
            },
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.UniqueConstraint(fields=('channel', 'name'), name='fq_schedule_channel_name'),
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.UniqueConstraint(condition=models.Q(('source', 'code')), fields=('name',), name='fq_schedule_code_name'),
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.CheckConstraint(condition=models.Q(('missed__in', ['latest', 'skip', 'catch_up'])), name='fq_schedule_missed_valid'),
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.CheckConstraint(condition=models.Q(('catch_up_max__gte', 1), ('catch_up_max__lte', 1000)), name='fq_schedule_catch_up_range'),
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.CheckConstraint(condition=models.Q(('jitter__gte', datetime.timedelta(0)), ('jitter__lte', datetime.timedelta(days=1))), name='fq_schedule_jitter_range'),
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.CheckConstraint(condition=models.Q(('source__in', ['code', 'admin'])), name='fq_schedule_source_valid'),
        ),
        migrations.AddConstraint(
            model_name='schedule',
            constraint=models.CheckConstraint(condition=models.Q(('task_name', ''), _negated=True), name='fq_schedule_task_name'),
        ),
        migrations.AddIndex(
            model_name='schedulefire',
            index=models.Index(models.F('fired_at'), name='fq_fire_fired_idx'),
        ),
        migrations.AddConstraint(
            model_name='schedulefire',
            constraint=models.UniqueConstraint(fields=('schedule', 'slot_at'), name='fq_fire_schedule_slot'),
        ),
        migrations.RunSQL(
            sql=SQUASHED.FIRING_STATE,
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]
