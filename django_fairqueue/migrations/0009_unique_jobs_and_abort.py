"""Unique jobs, cancel and abort.

* ``fairqueue_message`` gains ``unique_key`` and ``unique_scope`` (a partial unique index,
  ``fq_message_unique_idx``, admits one message per channel and key while it holds the key) and
  ``abort_requested_at`` (an abort request for a running message, read by its worker's
  heartbeat); the state ``aborted`` joins the others, and pruning covers it.
* The functions are installed again from this migration's own copy
  (``sql/0009_unique_jobs_and_abort.sql``): ``fairqueue_enqueue_v1`` and
  ``fairqueue_enqueue_one_v1`` take the unique-job arguments (their old signatures are dropped
  first); ``fairqueue_enqueue_unique_v1`` is new.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import migration_sql

DROP_OLD_ENQUEUE = """
DROP FUNCTION IF EXISTS fairqueue_enqueue_one_v1(text, text, jsonb, smallint, timestamptz, integer,
    boolean, integer, interval, integer, integer, text, interval, boolean);
DROP FUNCTION IF EXISTS fairqueue_enqueue_v1(text[], text[], jsonb[], smallint[], timestamptz[],
    integer[], boolean[], integer, interval, integer, integer, text, interval[], boolean);
"""

DROP_NEW = """
DROP FUNCTION IF EXISTS fairqueue_enqueue_one_v1(text, text, jsonb, smallint, timestamptz, integer,
    boolean, integer, interval, integer, integer, text, interval, boolean, text, text, text);
DROP FUNCTION IF EXISTS fairqueue_enqueue_v1(text[], text[], jsonb[], smallint[], timestamptz[],
    integer[], boolean[], integer, interval, integer, integer, text, interval[], boolean, text[],
    text[], text[]);
DROP FUNCTION IF EXISTS fairqueue_enqueue_unique_v1(text[], text[], jsonb[], smallint[],
    timestamptz[], integer[], boolean[], interval[], text[], text[], text[], timestamptz, bigint[]);
"""


class Migration(migrations.Migration):

    dependencies = [
        ("fairqueue", "0007_worker_registry"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='message',
            name='fq_message_state_valid',
        ),
        migrations.RemoveIndex(
            model_name='message',
            name='fq_message_finished_idx',
        ),
        migrations.AddField(
            model_name='message',
            name='abort_requested_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='message',
            name='unique_key',
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name='message',
            name='unique_scope',
            field=models.CharField(blank=True, choices=[('queued', 'while queued'), ('active', 'while queued or running')], max_length=8, null=True),
        ),
        migrations.AlterField(
            model_name='message',
            name='state',
            field=models.CharField(choices=[('scheduled', 'scheduled'), ('ready', 'ready'), ('running', 'running'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('cancelled', 'cancelled'), ('aborted', 'aborted')], max_length=16),
        ),
        migrations.AddIndex(
            model_name='message',
            index=models.Index(models.F('finished_at'), condition=models.Q(('state__in', ['succeeded', 'cancelled', 'aborted'])), name='fq_message_finished_idx'),
        ),
        migrations.AddConstraint(
            model_name='message',
            constraint=models.CheckConstraint(condition=models.Q(('state__in', ['scheduled', 'ready', 'running', 'succeeded', 'failed', 'cancelled', 'aborted'])), name='fq_message_state_valid'),
        ),
        migrations.AddConstraint(
            model_name='message',
            constraint=models.UniqueConstraint(models.F('channel'), models.F('unique_key'), condition=models.Q(('unique_key__isnull', False), models.Q(('state__in', ('ready', 'scheduled')), models.Q(('state', 'running'), ('unique_scope', 'active')), _connector='OR')), name='fq_message_unique_idx'),
        ),
        migrations.AddConstraint(
            model_name='message',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('unique_key__isnull', True), ('unique_scope__isnull', True)), models.Q(('unique_key__isnull', False), ('unique_scope__in', ['queued', 'active'])), _connector='OR'), name='fq_message_unique_scope'),
        ),
        # Backwards: the new functions go and the previous migration's are installed again.
        migrations.RunSQL(
            DROP_OLD_ENQUEUE + migration_sql("0009_unique_jobs_and_abort"),
            DROP_NEW + migration_sql("0006_channel_state_outside_the_model"),
        ),
    ]
