"""The channel's base manager refuses what ``group.channels.add()`` writes (a group, which
follows from the channel's name). State only: nothing in the database changes."""

import django.db.models.manager
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0038_lock_stripes")]

    operations = [
        migrations.AlterModelOptions(
            name="channel",
            options={"base_manager_name": "base_objects", "ordering": ["name"]},
        ),
        migrations.AlterModelManagers(
            name="channel",
            managers=[
                ("objects", django.db.models.manager.Manager()),
                ("base_objects", django.db.models.manager.Manager()),
            ],
        ),
    ]
