"""A faster enqueue: ``fairqueue_enqueue_v1``'s path for a batch of one channel and one task,
and the message table's CHECK constraints in forms PostgreSQL reads faster.

* The functions are installed again from this migration's own copy (``sql/0018_*.sql``):
  ``fairqueue_enqueue_v1`` inserts a batch whose columns other than the payloads have one
  element each (one channel, one task, one priority and run time: the usual batch) from the
  payloads alone, its channel resolved once. Same signatures: reversing installs 0013's copy.
* PostgreSQL re-reads the stored expression of every CHECK constraint of a table (a text form
  of its parse tree) and plans it at the start of each statement that inserts or updates rows
  there: for ``fairqueue_message`` about 30 us of backend CPU per statement, a fifth of one
  ``enqueue()``'s, most of it in the three constraints whose Django-generated form spells out
  an array element by element (``state IN (...)`` is stored as ``state::text = ANY
  (ARRAY['scheduled'::varchar, ...]::text[])``, folded anew each time). The same constraints,
  with the same names, written with one array constant and fewer nodes, cost about 10 us less
  per statement; every enqueue, claim and completion statement writes message rows.
  The model keeps its ``CheckConstraint`` declarations (Django validates with them, and the
  migration state is unchanged): only the stored expressions change. Each form accepts exactly
  the rows the old one accepted, including the NULL cases a CHECK lets through (a unique key
  with no scope, which no statement writes, passes both forms of ``fq_message_unique_scope``).

Not atomic: the constraints are replaced ``NOT VALID`` in one short ``ALTER TABLE`` (no scan),
then validated in statements of their own, which scan the table without blocking writes.
Reversing puts the Django-generated forms back the same way.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql

#: name -> (compact form, the form Django generates from the model: its SQL, word for word)
FORMS = {
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


def _replace(which: int) -> tuple[str, ...]:
    """The statements that install form ``which`` (0 compact, 1 Django's) of every constraint."""
    clauses = []
    for name, forms in FORMS.items():
        clauses.append(f"DROP CONSTRAINT {name}")
        clauses.append(f"ADD CONSTRAINT {name} CHECK ({forms[which]}) NOT VALID")
    replace = "ALTER TABLE fairqueue_message\n    " + ",\n    ".join(clauses) + ";"
    validate = [f"ALTER TABLE fairqueue_message VALIDATE CONSTRAINT {name};" for name in FORMS]
    return (replace, *validate)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("fairqueue", "0017_channel_groups"),
    ]

    # A list: each statement runs in a transaction of its own (the migration is not atomic).
    operations = [
        migrations.RunSQL(_replace(0), _replace(1)),
        migrations.RunSQL(
            migration_sql("0018_faster_enqueue"), migration_sql("0017_channel_groups")
        ),
    ]
