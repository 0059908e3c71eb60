"""A faster enqueue: ``fairqueue_enqueue_v1``'s path for a batch of one channel and one task
(the ``enqueue`` family), and the message table's CHECK constraints in forms PostgreSQL reads
faster (see ``MESSAGE_CHECKS`` in the squashed migration). The model keeps Django's forms.

Not atomic: the constraints are replaced ``NOT VALID`` in one short ``ALTER TABLE`` (no scan),
then validated in statements of their own, which scan the table without blocking writes.
Reversing puts the Django-generated forms back the same way.
"""

import importlib

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

#: name -> (compact form, the form Django generates from the model), kept with the squashed
#: migration that creates them for new databases.
FORMS = importlib.import_module(
    "django_fairqueue.migrations.0001_squashed_0027_worker_queues"
).MESSAGE_CHECKS


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
        InstallFunctions("enqueue"),
    ]
