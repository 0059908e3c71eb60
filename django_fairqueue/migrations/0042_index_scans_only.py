"""The claim, the completion, the enqueue and the work-batch claim plan no sequential scan, and
the claim updates the rows it locked by their tuple ids. A plan made while a table looked small
read every pending delta in the claims' probes for waking channels, the whole channel table once
per settled channel, and at every enqueue. Installs the claim, settle, enqueue and batches
families.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0041_virtual_time_per_queue")]

    operations = [InstallFunctions("claim", "settle", "enqueue", "batches")]
