"""The enqueue's wake-up decision reads the channel row before the channel's head.

``fairqueue_enqueue_one_v1`` and ``fairqueue_enqueue_v1`` decide whether to NOTIFY. They no
longer read the channel's head when a claim left the channel backlogged (its counted
``ready_count`` is above zero): a worker that will come back to it is busy, and no idle worker
can take it sooner. That is the usual case under load, and there the head of the channel's
ready index holds the entries claims left dead until vacuum, which the probe walked (the
``enqueue`` family); same signatures.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [
        ("fairqueue", "0020_group_cap_covers_batches"),
    ]

    operations = [
        InstallFunctions("enqueue"),
    ]
