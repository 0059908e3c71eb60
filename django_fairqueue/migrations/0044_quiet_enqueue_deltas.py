"""An enqueue to a channel that already counts ready messages writes a quiet counter delta (it
cannot make the channel claimable): the maintenance loop folds it in bulk, instead of every
claim folding one first. A claim about to take all a channel counts adds the channel's quiet
deltas first (fq_delta_quiet_idx finds them); whatever brings a count to zero where an enqueue
may be in flight leaves a `drained` marker, one per channel (fq_delta_drained_uniq), that a
claim's fold takes up once no enqueue holds the channel's name. Installs the fold_counters,
claim, enqueue, verify_repair and groups families.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0043_idle_reads_plan_no_seqscan")]

    operations = [
        migrations.AddField(
            model_name="channeldelta",
            name="drained",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddIndex(
            model_name="channeldelta",
            index=models.Index(
                models.F("channel"),
                condition=models.Q(("ready__gt", 0), ("wake", False)),
                name="fq_delta_quiet_idx",
            ),
        ),
        # the claim's housekeeping probes waking deltas and markers with one index
        migrations.RemoveIndex(model_name="channeldelta", name="fq_delta_wake_idx"),
        migrations.AddIndex(
            model_name="channeldelta",
            index=models.Index(
                models.F("id"),
                condition=models.Q(("wake", True), ("drained", True), _connector="OR"),
                name="fq_delta_wake_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="channeldelta",
            constraint=models.UniqueConstraint(
                condition=models.Q(("drained", True)),
                fields=("channel",),
                name="fq_delta_drained_uniq",
            ),
        ),
        # (the fold's new argument, p_drained, makes a new signature)
        migrations.RunSQL(
            "DROP FUNCTION IF EXISTS fairqueue_fold_deltas_v1(integer, boolean, boolean)",
            migrations.RunSQL.noop,
        ),
        InstallFunctions("groups", "fold_counters", "claim", "enqueue", "verify_repair"),
    ]
