"""The worker's claims and completions may commit without waiting for their WAL flush:
``fairqueue_claim_v1`` and ``fairqueue_complete_v1`` take ``p_async_commit`` (default false),
and ``fairqueue_hold_commit_v1`` / ``fairqueue_relax_commit_v1`` keep a last attempt's commit
durable. The old signatures are dropped first; callers that leave the new parameter out get
the old behaviour."""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

DROP_OLD_SIGNATURES = """
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
                                           boolean, integer, boolean, text[]);
DROP FUNCTION IF EXISTS fairqueue_complete_v1(bigint[], uuid[], jsonb[], double precision[]);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0031_worker_wakeups")]

    operations = [
        migrations.RunSQL(DROP_OLD_SIGNATURES, migrations.RunSQL.noop),
        InstallFunctions("locks_clocks", "claim", "settle"),
    ]
