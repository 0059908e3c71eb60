"""A rate limit removed or shortened takes effect at once, however the row is written.

Before, only the channel group admin moved a waiting group's next release back; a channel (or a
group written through the ORM, ``update()``, or SQL) kept waiting until the release the old
interval had set, up to a day. A trigger on both tables now does it for every writer (only an
update naming ``release_interval`` fires it). Installs only the family it changes: groups.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0035_lighter_claim_writes")]

    operations = [InstallFunctions("groups")]
