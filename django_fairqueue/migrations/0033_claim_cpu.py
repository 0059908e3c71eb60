"""The claim's server time.

* A claim does its housekeeping only when there is some: one statement probes for due
  scheduled messages and waking deltas and reads the queues of claimable flows (the highest
  ones only when there is a lowest), and the promotion and the fold are called only when their
  probe found work (an idle poll called both to find nothing, then probed the queues and the
  deltas again).
* ``fairqueue_channel.claimable``, a stored generated column (ready messages, not paused, under
  its cap), is what the four walk indexes' predicates read, instead of the counters themselves.
  PostgreSQL updates a row in place of its page (a HOT update: no new index entry, no unique
  check of the name) only when no indexed column changes, predicates' columns included: with
  the counters in the predicates, every fold of an enqueue into a channel that was claimable
  already wrote a new entry into each of the channel's indexes. Now such a fold changes no
  indexed column (the table's fillfactor of 70 leaves room on its pages for such versions).
* The fold of counter deltas deletes the deltas and adds their sums to the channels in one
  statement, and leaves the probe for waking deltas to its callers (the claim probes them in
  its first statement; the batch claim and the claim's housekeeping statement probe before
  calling it).

Installs only the families it changes: locks and clocks, fold and counters, queues, claim,
work batches.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

OLD = """ready_count > 0 AND NOT paused
  AND (max_concurrency IS NULL OR running_count < max_concurrency)"""


def _indexes(claimable: str) -> str:
    return f"""
DROP INDEX IF EXISTS fq_channel_turn_idx;
DROP INDEX IF EXISTS fq_channel_vtime_idx;
DROP INDEX IF EXISTS fq_channel_in_group_turn_idx;
DROP INDEX IF EXISTS fq_channel_in_group_vtime_idx;
CREATE INDEX fq_channel_turn_idx ON fairqueue_channel (queue, next_turn_at, id)
WHERE {claimable} AND group_id IS NULL;
CREATE INDEX fq_channel_vtime_idx ON fairqueue_channel (queue, vtime, id)
WHERE {claimable} AND group_id IS NULL;
CREATE INDEX fq_channel_in_group_turn_idx ON fairqueue_channel (group_id, next_turn_at, id)
WHERE group_id IS NOT NULL AND {claimable};
CREATE INDEX fq_channel_in_group_vtime_idx ON fairqueue_channel (group_id, vtime, id)
WHERE group_id IS NOT NULL AND {claimable};
"""


ADD_COLUMN = f"""
ALTER TABLE fairqueue_channel
    ADD COLUMN IF NOT EXISTS claimable boolean GENERATED ALWAYS AS ({OLD}) STORED;
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0032_async_commit")]

    operations = [
        # Backwards: the old indexes come back, and the column stays (the functions, which
        # unapplying leaves as they are, read it).
        migrations.RunSQL(ADD_COLUMN + _indexes("claimable"), _indexes(OLD)),
        InstallFunctions("locks_clocks", "fold_counters", "queues", "claim", "batches"),
    ]
