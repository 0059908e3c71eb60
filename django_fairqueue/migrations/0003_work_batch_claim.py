"""Work-batch claim: round-robin state on channels, the running-batches index, the lease check
and the claim function (the ``batches`` family)."""

import django.db.models.functions.datetime
from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

DROP_BATCHES_V1 = """
DROP FUNCTION IF EXISTS fairqueue_claim_batch_v1(text, interval, text[], text[], bigint[], bigint[]);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("fairqueue", "0002_functions_v1"),
    ]

    operations = [
        migrations.AddField(
            model_name="channel",
            name="batch_pending",
            field=models.BooleanField(db_default=False, editable=False),
        ),
        migrations.AddField(
            model_name="channel",
            name="batch_turn_at",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(), editable=False
            ),
        ),
        migrations.AddField(
            model_name="channel",
            name="batch_turn_used",
            field=models.PositiveIntegerField(db_default=0, editable=False),
        ),
        migrations.AddIndex(
            model_name="channel",
            index=models.Index(
                models.F("batch_turn_at"),
                models.F("id"),
                condition=models.Q(("batch_pending", True), ("paused", False)),
                name="fq_channel_batch_turn_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="workbatch",
            index=models.Index(
                models.F("channel"),
                condition=models.Q(("state", "running")),
                name="fq_batch_running_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="workbatch",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("state", "running"), ("lease_token__isnull", False)),
                    models.Q(
                        models.Q(("state", "running"), _negated=True), ("lease_token__isnull", True)
                    ),
                    _connector="OR",
                ),
                name="fq_batch_lease_iff_running",
            ),
        ),
        migrations.RunSQL(migrations.RunSQL.noop, DROP_BATCHES_V1),
        InstallFunctions("batches"),
    ]
