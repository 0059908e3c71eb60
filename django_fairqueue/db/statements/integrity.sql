-- django-fairqueue: the integrity recount: counters and holds checked against the rows they
-- count, and repaired.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/integrity_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: verify_channel_counters
-- Channels (of `ids`, or all) whose counters disagree with their messages and work batches.
SELECT channel_id, channel_name, counter, recorded, actual
FROM fairqueue_verify_channels_v1(%(ids)s::bigint[]);

-- name: repair_channel_counters
-- Recount the channels of `ids` from their messages and work batches, each under its row lock; returns what was wrong.
SELECT channel_id, channel_name, counter, recorded, actual
FROM fairqueue_repair_channels_v1(%(ids)s::bigint[]);

-- name: verify_group_counters
-- Channel groups (of `ids`, or all) whose sums (ready, running, claimable channels) disagree with their channels' rows.
-- One snapshot: the trigger that keeps the sums writes them in the transactions that change
-- the channels, so a consistent snapshot shows them equal. The repair runs it again after
-- `lock_groups`, in a statement of its own, so that it sees every change committed before.
SELECT g.id, g.name, x.counter, x.recorded, x.actual
FROM fairqueue_channel_group g
CROSS JOIN LATERAL (
    SELECT coalesce(sum(c.ready_count), 0)::bigint AS ready,
           coalesce(sum(c.running_count), 0)::bigint AS running,
           count(*) FILTER (WHERE c.ready_count > 0 AND NOT c.paused
                            AND (c.max_concurrency IS NULL
                                 OR c.running_count < c.max_concurrency))::bigint AS claimable
    FROM fairqueue_channel c WHERE c.group_id = g.id
) s
CROSS JOIN LATERAL (VALUES ('ready', g.ready_count, s.ready),
                           ('running', g.running_count, s.running),
                           ('claimable channels', g.claimable::bigint, s.claimable))
    AS x(counter, recorded, actual)
WHERE (%(ids)s::bigint[] IS NULL OR g.id = ANY (%(ids)s::bigint[]))
  AND x.recorded <> x.actual
ORDER BY g.id, x.counter;

-- name: lock_groups
-- Lock channel groups (the repair of their sums), in id order, waiting: rank 3 of the lock order,
-- taken holding nothing else. A writer of one of their channels then waits in the trigger, its
-- channel change not yet committed, and applies its change to the repaired sums afterwards.
SELECT g.id FROM fairqueue_channel_group g
WHERE g.id = ANY (%(ids)s::bigint[])
ORDER BY g.id
FOR NO KEY UPDATE;

-- name: set_group_sums
-- Write recounted sums of groups `lock_groups` holds (NULL in an array: that sum is right).
UPDATE fairqueue_channel_group g
SET ready_count = coalesce(v.ready, g.ready_count),
    running_count = coalesce(v.running, g.running_count),
    claimable = coalesce(v.claimable, g.claimable)
FROM unnest(%(ids)s::bigint[], %(ready)s::bigint[], %(running)s::bigint[],
            %(claimable)s::integer[]) AS v(id, ready, running, claimable)
WHERE g.id = v.id;

-- name: verify_unique_holds
-- Channels whose messages of scope 'active' that hold their unique key (ready, scheduled,
-- running) are not all named by their key's hold row in fairqueue_unique_hold: (channel id,
-- name, 'unique holds', how many are named, how many there are). A message and its hold row
-- are written in one transaction, so one snapshot sees both or neither. Read-only, lock-free.
SELECT m.channel_id, coalesce(c.name, '(none)'), 'unique holds',
       count(*) FILTER (WHERE h.message_id = m.id), count(*)
FROM fairqueue_message m
LEFT JOIN fairqueue_unique_hold h
  ON h.channel_id = m.channel_id AND h.unique_key = m.unique_key
LEFT JOIN fairqueue_channel c ON c.id = m.channel_id
WHERE m.unique_key IS NOT NULL AND m.unique_scope = 'active'
  AND m.state IN ('ready', 'scheduled', 'running')
GROUP BY m.channel_id, c.name
HAVING count(*) FILTER (WHERE h.message_id = m.id) <> count(*)
ORDER BY m.channel_id;

-- name: repair_unique_holds
-- Make the hold row of each key of the channels `ids` name the message of scope 'active' that
-- holds it (ready, scheduled, running) when the row is missing or names a message that holds
-- nothing. A row naming another live holder is left alone (two messages hold the key: the
-- operator's to settle; verify reports it again). Returns the ids now named.
INSERT INTO fairqueue_unique_hold AS h (channel_id, unique_key, message_id)
SELECT DISTINCT ON (m.channel_id, m.unique_key) m.channel_id, m.unique_key, m.id
FROM fairqueue_message m
WHERE m.channel_id = ANY (%(ids)s::bigint[])
  AND m.unique_key IS NOT NULL AND m.unique_scope = 'active'
  AND m.state IN ('ready', 'scheduled', 'running')
  AND NOT EXISTS (
      SELECT FROM fairqueue_unique_hold x
      WHERE x.channel_id = m.channel_id AND x.unique_key = m.unique_key AND x.message_id = m.id)
ORDER BY m.channel_id, m.unique_key, m.id
ON CONFLICT (channel_id, unique_key) DO UPDATE SET message_id = excluded.message_id
WHERE NOT EXISTS (
    SELECT FROM fairqueue_message o
    WHERE o.id = h.message_id AND o.channel_id = h.channel_id AND o.unique_key = h.unique_key
      AND o.unique_scope = 'active' AND o.state IN ('ready', 'scheduled', 'running'))
RETURNING h.message_id;

-- name: verify_orphans
-- Messages, deltas and work batches whose channel no longer exists, by table.
SELECT tbl, n FROM fairqueue_verify_orphans_v1();

-- name: repair_orphans
-- Delete messages, deltas and work batches whose channel no longer exists; returns how many by table.
SELECT tbl, n FROM fairqueue_repair_orphans_v1();
