"""What every claim pays for its writes, made lighter.

* One lease token per claim: the messages a claim hands out share one fresh random token (it
  fences one claim from every other, as before). Where PostgreSQL is built without OpenSSL,
  ``gen_random_uuid()`` opens, reads and closes ``/dev/urandom`` each time, and a token per
  message cost about a tenth of a claim of 100's server CPU.
* The claim's arrays start NULL: an idle poll returns before the walk that fills them, and
  their initial values (each an expression PL/pgSQL prepares again in every transaction, then
  casts and expands) were a sixth of its time in the function.
* Fewer CHECK constraints to evaluate. PostgreSQL parses and evaluates every CHECK of a table at
  each update of a row, whatever columns change: the claim's and the fold's counter updates
  paid for ``weight >= 0``, ``max_concurrency >= 0``, ``max_backlog >= 0`` and
  ``max_attempts >= 0``, which Django's positive integer fields add and the range constraints
  already imply. The fields are plain integers now; their ranges are unchanged.
* The channel trigger that keeps a group's sums asks the database only whether the channel is
  grouped (its WHEN clause is parsed by each statement that updates a channel's counters); the
  trigger function tells whether anything it follows changed.

Dropping the constraints takes a brief ACCESS EXCLUSIVE lock on each table and scans nothing.
Installs only the families it changes: claim, groups.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0034_state_index_without_running")]

    operations = [
        migrations.AlterField(
            model_name="channel",
            name="max_backlog",
            field=models.IntegerField(
                blank=True,
                help_text=(
                    "Most messages waiting (ready + scheduled). Enqueue past it fails. "
                    "Empty: no limit."
                ),
                null=True,
            ),
        ),
        migrations.AlterField(
            model_name="channel",
            name="max_concurrency",
            field=models.IntegerField(
                blank=True,
                help_text=(
                    "Most messages of this channel running at once, fleet-wide. Empty: no limit."
                ),
                null=True,
            ),
        ),
        migrations.AlterField(
            model_name="channel",
            name="weight",
            field=models.SmallIntegerField(
                default=1,
                help_text="Share of the workers while backlogged: weight 2 gets twice weight 1.",
            ),
        ),
        migrations.AlterField(
            model_name="channelgroup",
            name="max_concurrency",
            field=models.IntegerField(
                blank=True,
                help_text=(
                    "Most messages of all this group's channels running at once, fleet-wide. "
                    "Empty: no limit."
                ),
                null=True,
            ),
        ),
        migrations.AlterField(
            model_name="channelgroup",
            name="weight",
            field=models.SmallIntegerField(
                default=1,
                help_text=(
                    "Share of the workers while backlogged, against other groups and ungrouped "
                    "channels: weight 2 gets twice weight 1."
                ),
            ),
        ),
        migrations.AlterField(
            model_name="message",
            name="max_attempts",
            field=models.IntegerField(default=1),
        ),
        InstallFunctions("claim", "groups"),
    ]
