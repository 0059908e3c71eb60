-- django-fairqueue: periodic schedules (django_fairqueue.schedules): due schedules, their
-- slots and fires.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/schedule_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: select_due_schedules
-- Schedules a firing pass handles now: enabled ones whose next slot is due (fq_schedule_next_idx)
-- and any whose state was computed for another spec (`stale`, fq_schedule_stale_idx: new,
-- edited, paused or resumed), skipping the tasks this process does not know and the schedules
-- it holds back (they could not fire: a full channel, an error; retried at their own pace). Read
-- without locks: the slot's
-- unique key (claim_schedule_slots) and the check of what was read (advance_schedule) decide
-- who fires. In random order, so workers looking at once start on different schedules.
SELECT s.id, s.name, c.name, s.task_name, s.args, s.kwargs, s.cron, s.timezone, s.missed,
       s.catch_up_max, s.jitter, s.priority, s.enabled, s.spec, s.fired_spec, s.next_fire_at,
       s.last_slot_at, now()
FROM fairqueue_schedule s
JOIN fairqueue_channel c ON c.id = s.channel_id
WHERE ((s.enabled AND s.next_fire_at <= now()) OR s.stale)
  AND s.task_name <> ALL(%(skip_tasks)s::text[])
  AND s.id <> ALL(%(skip_ids)s::bigint[])
ORDER BY random()
LIMIT %(limit)s::integer;

-- name: select_next_schedule_fire
-- Seconds from now to the earliest next slot of an enabled schedule (fq_schedule_next_idx); 0
-- when a schedule waits for a fresh slot (fq_schedule_stale_idx); NULL when there is none. The
-- schedules this process holds back (skip_ids) are left out: it knows when it retries them.
SELECT CASE
    WHEN EXISTS (
        SELECT 1 FROM fairqueue_schedule s
        WHERE s.stale AND s.task_name <> ALL(%(skip_tasks)s::text[])
          AND s.id <> ALL(%(skip_ids)s::bigint[])
    ) THEN 0::double precision
    ELSE extract(epoch FROM (
        SELECT min(s.next_fire_at) FROM fairqueue_schedule s
        WHERE s.enabled AND s.task_name <> ALL(%(skip_tasks)s::text[])
          AND s.id <> ALL(%(skip_ids)s::bigint[])
    ) - now())::double precision
END;

-- name: claim_schedule_slots
-- Take slots of a schedule: one fire row per slot, unique on (schedule_id, slot_at), in the
-- transaction that enqueues their messages. A slot another transaction has (committed, or in
-- flight: this waits for its end) is not returned, and the caller gives up the schedule.
INSERT INTO fairqueue_schedule_fire AS f (schedule_id, slot_at, fired_at)
SELECT %(schedule_id)s::bigint, slot, clock_timestamp()
FROM unnest(%(slots)s::timestamptz[]) AS slot
ORDER BY slot
ON CONFLICT (schedule_id, slot_at) DO NOTHING
RETURNING f.slot_at;

-- name: advance_schedule
-- Record a firing pass of one schedule (its slots' messages, its next slot and the spec they
-- were computed for), only if the row is still as the pass read it: same spec, fired spec, next
-- and last slot. An edit, a pause or a concurrent pass that advanced it first makes this match
-- no row, and the caller rolls its transaction back (its slots and messages with it).
WITH fired AS (
    UPDATE fairqueue_schedule_fire f SET message_id = m.message_id
    FROM unnest(%(slots)s::timestamptz[], %(message_ids)s::bigint[]) AS m(slot_at, message_id)
    WHERE f.schedule_id = %(schedule_id)s::bigint AND f.slot_at = m.slot_at
)
UPDATE fairqueue_schedule s SET
    next_fire_at = %(next_fire_at)s::timestamptz,
    last_slot_at = COALESCE(%(last_slot)s::timestamptz, s.last_slot_at),
    last_fired_at = CASE WHEN %(last_message_id)s::bigint IS NULL THEN s.last_fired_at
                         ELSE clock_timestamp() END,
    last_message_id = COALESCE(%(last_message_id)s::bigint, s.last_message_id),
    fired_spec = s.spec
WHERE s.id = %(schedule_id)s::bigint
  AND s.spec = %(spec)s::text
  AND s.fired_spec IS NOT DISTINCT FROM %(seen_fired_spec)s::text
  AND s.next_fire_at IS NOT DISTINCT FROM %(seen_next)s::timestamptz
  AND s.last_slot_at IS NOT DISTINCT FROM %(seen_last)s::timestamptz
RETURNING s.id;

-- name: advance_schedules_without_slots
-- Write the next slot of schedules a pass fires nothing for (new, edited, paused or resumed ones,
-- and slots skipped by their policy), each only if its row is still as the pass read it (as
-- advance_schedule). Rows another transaction holds are skipped, not waited for (no lock order
-- between two such statements to keep): the next pass sees them again.
WITH wanted AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(next)s::timestamptz[], %(specs)s::text[],
                         %(seen_fired)s::text[], %(seen_next)s::timestamptz[],
                         %(seen_last)s::timestamptz[])
        AS u(id, next_fire_at, spec, seen_fired, seen_next, seen_last)
), locked AS (
    SELECT s.id FROM fairqueue_schedule s
    WHERE s.id = ANY(%(ids)s::bigint[])
    ORDER BY s.id
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE fairqueue_schedule s SET next_fire_at = w.next_fire_at, fired_spec = s.spec
FROM wanted w
JOIN locked l ON l.id = w.id
WHERE s.id = w.id
  AND s.spec = w.spec
  AND s.fired_spec IS NOT DISTINCT FROM w.seen_fired
  AND s.next_fire_at IS NOT DISTINCT FROM w.seen_next
  AND s.last_slot_at IS NOT DISTINCT FROM w.seen_last
RETURNING s.id;

-- name: select_schedule_states
-- The firing state of schedules, for the admin and `fairqueue schedules`; `current` is false
-- while the state was computed for another spec (the next pass computes a fresh slot).
SELECT s.id, s.next_fire_at, s.last_slot_at, s.last_fired_at, s.last_message_id,
       NOT s.stale AS current
FROM fairqueue_schedule s
WHERE s.id = ANY(%(ids)s::bigint[]);

-- name: lock_schedule_sync
-- Serialises the syncs of code-declared schedules (workers starting together): an advisory
-- lock of its own namespace (26229), held to commit and taken before any schedule row.
-- The wait is bounded by `lock_timeout` (then SQLSTATE 55P03): a worker frozen in the middle
-- of its sync must not hold every other worker's maintenance (and so its rescues) with it.
-- The transaction's previous lock_timeout is put back once the lock is held.
WITH prev AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS v,
           set_config('lock_timeout', %(lock_timeout)s::text, true) AS s
), locked AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(26229, 0) FROM prev
)
SELECT set_config('lock_timeout', (SELECT v FROM prev), true) FROM locked;

-- name: prune_schedule_fires
-- Forget fired slots older than `before`, at most `limit` (fq_fire_fired_idx): a schedule's
-- slots only move forward, so an old slot never comes up again.
DELETE FROM fairqueue_schedule_fire f
WHERE f.id IN (
    SELECT o.id FROM fairqueue_schedule_fire o
    WHERE o.fired_at < %(before)s::timestamptz
    LIMIT %(limit)s::integer
);
