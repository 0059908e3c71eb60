"""The index of every message of a channel, (channel_id, id), for the admin's channel filter and
its sort by channel (docs/performance.md, "The admin at a million messages").

Built CONCURRENTLY, so enqueue, claims and completions go on while it builds (a minute or two
per ten million messages); hence not atomic. Reversing drops it.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("fairqueue", "0007_worker_registry"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="message",
            index=models.Index(models.F("channel"), models.F("id"), name="fq_message_channel_idx"),
        ),
    ]
