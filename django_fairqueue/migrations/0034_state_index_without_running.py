"""The admin's state index, ``fq_message_state_idx (state, id)``, leaves running messages out.

A claim changes each message it takes from ready to running, an update PostgreSQL cannot make
in place (the state is an indexed column), so every index with an entry for the new row version
gets one: with the running rows left out of this index, a claim writes three index entries per
message taken instead of four. The admin's state filter for running messages reads
``fq_message_lease_idx`` (running rows only, at most the fleet's slots) instead.

Built CONCURRENTLY, so enqueue, claims and completions go on while it builds (seconds per
million messages); hence not atomic. Between the drop and the build, the admin's state filter
walks the primary key. Reversing restores the full index.
"""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("fairqueue", "0033_claim_cpu"),
    ]

    operations = [
        RemoveIndexConcurrently(model_name="message", name="fq_message_state_idx"),
        AddIndexConcurrently(
            model_name="message",
            index=models.Index(
                models.F("state"),
                models.F("id"),
                condition=models.Q(("state", "running"), _negated=True),
                name="fq_message_state_idx",
            ),
        ),
    ]
