"""Claims by time made as light as claims by count: the merge of the locked channels' start tags
stops at a tag no message of the batch starts after (a claim of 100 over 25 channels sorted
2,500 start tags to keep 100); a turn only sizes the walk, so a claim of 100 locks 25 channels,
not the 35 to 46 that turns left from earlier claims made it lock; and the smallest claimable
tag is read by the walk's statement instead of one of its own (fairqueue_turn_left_v1 is new).
And a worker's idle poll that finds no housekeeping to do no longer relaxes its commit (it
writes nothing). Installs the claim family (claim.sql, and plan_grouped.sql, the claim's plan
with groups, now a file of its own).
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0044_quiet_enqueue_deltas")]

    operations = [InstallFunctions("claim")]
