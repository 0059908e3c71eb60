"""Fairness by time: a channel with no run time measured yet gets one message at a time.

A new tenant's channel is charged a default estimate per message until its first settlements
fold; a claim of several could give it every free worker at once, and with long tasks every
other tenant then waited a whole task. Until its first settlement folds, the claim now gives
such a channel one message at a time (slow start). Installs only the family it changes: claim.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0036_rate_limit_rearm")]

    operations = [InstallFunctions("claim")]
