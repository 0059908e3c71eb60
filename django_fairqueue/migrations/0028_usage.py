"""Per-tenant usage and every attempt's error.

* ``fairqueue_usage``: per channel and hour, the attempts settled, how they ended and the
  worker time they took (written by the workers' statistics flush, pruned after
  ``FAIRQUEUE['USAGE_RETENTION']``); ``fairqueue_usage_total``: the same per channel since it
  was first recorded, never pruned (the Prometheus counters).
* ``fairqueue_message.errors``: the bounded history of a message's failed attempts, appended by
  the trigger ``fairqueue_message_errors`` (function ``fairqueue_message_errors_v1``, the
  ``errors`` family of ``db/functions/``) whenever a statement writes a new ``last_error``.
* ``fairqueue_worker.supervisor``: the ``runfairworker --processes`` supervisor (``host:pid``)
  of a worker process, so the admin lists its children together.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

DROP = """
DROP TRIGGER IF EXISTS fairqueue_message_errors ON fairqueue_message;
DROP FUNCTION IF EXISTS fairqueue_message_errors_v1();
"""

class Migration(migrations.Migration):

    dependencies = [
        ('fairqueue', '0027_worker_queues'),
    ]

    operations = [
        migrations.CreateModel(
            name='UsageTotal',
            fields=[
                ('channel_id', models.BigIntegerField(primary_key=True, serialize=False)),
                ('attempts', models.BigIntegerField(default=0)),
                ('succeeded', models.BigIntegerField(default=0)),
                ('failures', models.BigIntegerField(default=0)),
                ('timeouts', models.BigIntegerField(default=0)),
                ('worker_ms', models.BigIntegerField(default=0)),
            ],
            options={
                'db_table': 'fairqueue_usage_total',
            },
        ),
        migrations.AddField(
            model_name='message',
            name='errors',
            field=models.JSONField(blank=True, editable=False, null=True),
        ),
        migrations.CreateModel(
            name='UsageHour',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('hour', models.DateTimeField()),
                ('channel_id', models.BigIntegerField()),
                ('channel_name', models.CharField(max_length=200)),
                ('group_name', models.CharField(blank=True, default='', max_length=200)),
                ('attempts', models.BigIntegerField(default=0)),
                ('succeeded', models.BigIntegerField(default=0)),
                ('failures', models.BigIntegerField(default=0)),
                ('timeouts', models.BigIntegerField(default=0)),
                ('worker_ms', models.BigIntegerField(default=0)),
            ],
            options={
                'db_table': 'fairqueue_usage',
                'verbose_name': 'usage hour',
                'verbose_name_plural': 'usage per tenant',
                'constraints': [models.UniqueConstraint(fields=('hour', 'channel_id'), name='fq_usage_hour_channel')],
            },
        ),
        migrations.AddField(
            model_name="workerrecord",
            name="supervisor",
            field=models.CharField(blank=True, db_default="", default="", max_length=300),
        ),
        # Backwards: the trigger and its function go.
        migrations.RunSQL(migrations.RunSQL.noop, DROP),
        InstallFunctions("errors"),
    ]
