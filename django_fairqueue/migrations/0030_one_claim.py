"""One claim, groups charged by time as channels are, and enqueue wake-ups that a removal
cannot silence.

- ``fairqueue_claim_v1`` takes and charges in one statement whether it walked channel groups
  or not: the grouped walk and share become ``fairqueue_plan_grouped_v1``, which returns its
  plan instead of claiming (``fairqueue_claim_grouped_v1`` is dropped).
- The folds correct a group's tag by its channels' real run time
  (``fairqueue_correct_groups_v1``), and the counter repair keeps the run times of the deltas
  it deletes.
- ``fq_delta_lowered_idx``: deltas that took ready messages out (a cancel, purge, delete or
  abort), which the enqueue's wake-up decision now subtracts from the counted backlog.

Installs only the families it changes: fold_counters, claim, enqueue, verify_repair.
"""

from django.db import migrations, models
from django.db.models import F, Q

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0029_services")]

    operations = [
        migrations.AddIndex(
            model_name="channeldelta",
            index=models.Index(F("channel"), condition=Q(ready__lt=0), name="fq_delta_lowered_idx"),
        ),
        # Its result type changed (it returns a plan now), and so did its name: the old one
        # would stay callable.
        migrations.RunSQL(
            "DROP FUNCTION IF EXISTS fairqueue_claim_grouped_v1(integer, interval, text, "
            "bigint[], bigint[], integer, integer, boolean, timestamptz, text);",
            migrations.RunSQL.noop,
        ),
        InstallFunctions("fold_counters", "claim", "enqueue", "verify_repair"),
    ]
