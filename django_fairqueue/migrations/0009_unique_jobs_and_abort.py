"""Unique jobs, cancel and abort.

* ``fairqueue_message`` gains ``unique_key``, ``unique_scope`` (``fq_message_unique_idx``) and
  ``abort_requested_at``; the state ``aborted`` joins the others.
* The ``enqueue`` family: ``fairqueue_enqueue_v1`` and ``fairqueue_enqueue_one_v1`` take the
  unique-job arguments (old signatures dropped first); ``fairqueue_enqueue_unique_v1`` is new.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

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
        # Backwards: the new functions go.
        migrations.RunSQL(DROP_OLD_ENQUEUE, DROP_NEW),
        InstallFunctions("enqueue"),
    ]
