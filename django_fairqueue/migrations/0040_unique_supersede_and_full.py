"""A unique job is superseded by a newer message already running, and a held key is kept,
replaced or raised on a full channel.

A unique job of scope ``queued`` that failed with a retry due went back to the queue when the
newer message that took its key had already been claimed (a free thread claims before the
failure is settled): the job ran twice. A retry, release or rescue now also counts a newer
message of the key that is running, whatever its scope (``fairqueue_unique_superseded_v1``);
what "held" means for an enqueue does not change.
A keyed enqueue on a channel at its ``max_backlog`` raised ``ChannelFull`` before looking at
the key, although a keep or replace adds no waiting message: a batch with unique keys is now
bounded on the messages it inserts, after the held keys' policies (a raise: ``DuplicateJob``).
Installs the families it changes: unique_holds, enqueue and backlog. Deploy the code with it:
the statements that settle messages call the new function.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0039_channel_base_manager")]

    operations = [InstallFunctions("unique_holds", "enqueue", "backlog")]
