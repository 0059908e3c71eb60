"""Two indexes for the admin's message list at scale (docs/performance.md, "The admin at a
million messages"): every message of a channel, (channel_id, id), for the channel filter and the
sort by channel; every message in a state, (state, id), for the state filter.

Built CONCURRENTLY, so enqueue, claims and completions go on while they build (seconds per
million messages); hence not atomic. Reversing drops them.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("fairqueue", "0010_unique_batches_in_key_order"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="message",
            index=models.Index(models.F("channel"), models.F("id"), name="fq_message_channel_idx"),
        ),
        AddIndexConcurrently(
            model_name="message",
            index=models.Index(models.F("state"), models.F("id"), name="fq_message_state_idx"),
        ),
    ]
