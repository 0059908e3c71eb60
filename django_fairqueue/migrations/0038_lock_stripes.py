"""Enqueues of many channels, and the bounded-backlog check, hold at most 128 advisory locks.

An enqueue held one lock per channel name until its commit, and the bounded-backlog check one
per bounded channel; PostgreSQL keeps such locks in one table for every session, so a batch to
a few thousand channels filled it and every session's next lock (other tenants' enqueues) failed
with "out of shared memory". A batch of more than 128 names now holds their stripes (one of
128), the backlog check always does; deleting a channel takes its name's lock and its stripe's.
Installs the families it changes: locks_clocks (the stripes), enqueue and backlog. Deploy the
code with it: a deletion by code of an earlier release does not wait for a batch of more than
128 names.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0037_time_slow_start")]

    operations = [InstallFunctions("locks_clocks", "enqueue", "backlog")]
