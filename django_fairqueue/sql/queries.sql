-- django-fairqueue: every statement the Python side runs against the queue tables.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description; store.py loads
-- this file once and has exactly one function per name (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.
-- Statements that settle a claim (heartbeat, complete, fail, release) match on the lease
-- token, so a claimant whose lease expired and was re-claimed changes nothing. A row has a
-- token exactly while it runs (CHECK fq_message_lease_iff_running), and tokens are random per
-- claim, so `id = ANY(ids) AND lease_token = ANY(tokens)` selects exactly the caller's running
-- rows. They deliberately say nothing about `state`: the planner would answer a state
-- condition with a partial index on running rows and scan all of them (13 ms for 100 rows
-- with 12,000 in flight) instead of 100 primary-key lookups.

-- name: enqueue_messages
-- Insert a batch of messages (creating channels on first use) in one round trip.
-- Parameters are bound in binary (the b placeholders): arrays then need no quoting or escaping per
-- element on either side. Payloads come as JSON text (text[]), checked by the caller.
SELECT id FROM fairqueue_enqueue_v1(
    %(channels)b::text[], %(tasks)b::text[], %(payloads)b::text[]::jsonb[],
    %(priorities)b::smallint[], %(run_at)b::timestamptz[], %(max_attempts)b::integer[],
    %(keep_result)b::boolean[], %(default_max_concurrency)b::integer,
    %(default_release_interval)b::interval, %(default_weight)b::integer,
    %(default_max_backlog)b::integer, %(notify_channel)b::text, %(delays)b::interval[],
    %(create)b::boolean, %(unique_keys)b::text[], %(unique_scopes)b::text[],
    %(on_conflict)b::text[]
) AS id;

-- name: enqueue_message
-- Insert one message (creating its channel on first use) in one round trip: enqueue_messages for one.
-- Scalar arguments, bound in binary: nothing to build per call but the values themselves.
SELECT fairqueue_enqueue_one_v1(
    %(channel)b::text, %(task)b::text, %(payload)b::text::jsonb, %(priority)b::smallint,
    %(run_at)b::timestamptz, %(max_attempts)b::integer, %(keep_result)b::boolean,
    %(default_max_concurrency)b::integer, %(default_release_interval)b::interval,
    %(default_weight)b::integer, %(default_max_backlog)b::integer, %(notify_channel)b::text,
    %(delay)b::interval, %(create)b::boolean, %(unique_key)b::text, %(unique_scope)b::text,
    %(on_conflict)b::text
) AS id;

-- name: create_channels
-- Create the named channels that do not exist (in name order), on a connection of its own, committed at once.
-- The lock timeout bounds the wait for a name another transaction is creating right now.
WITH timeout AS MATERIALIZED (
    SELECT set_config('lock_timeout', %(lock_timeout)s::text, true)
)
INSERT INTO fairqueue_channel (name, max_concurrency, release_interval, weight, paused,
                               max_backlog, created_at, next_turn_at)
SELECT n, %(default_max_concurrency)s::integer, %(default_release_interval)s::interval,
       %(default_weight)s::integer, false, %(default_max_backlog)s::integer, clock_timestamp(),
       clock_timestamp()
FROM timeout, unnest(%(names)s::text[]) AS n
ORDER BY n
ON CONFLICT (name) DO NOTHING;

-- name: ensure_groups
-- Create the named channel groups that do not exist (fairqueue_ensure_groups_v1).
SELECT fairqueue_ensure_groups_v1(%(names)s::text[]);

-- name: claim_messages
-- Fair claim of up to `limit` messages under fresh leases (see fairqueue_claim_v1).
SELECT id, channel_id, channel_name, task_name, payload, priority, attempts, max_attempts,
       keep_result, lease_token, lease_expires_at, enqueued_at, run_at
FROM fairqueue_claim_v1(
    %(limit)s::integer, %(lease)s::interval, %(worker)s::text, %(only)s::bigint[],
    %(exclude)s::bigint[], %(quantum)s::integer, %(maintain)s::boolean, %(wait_ms)s::integer,
    %(by_time)s::boolean, %(queues)s::text[]
);

-- name: prepare_claims
-- The claim's housekeeping on its own: promote due messages and fold waking deltas.
SELECT fairqueue_promote_due_v1(clock_timestamp(), 1000) AS promoted,
       fairqueue_fold_deltas_v1(1000, true, %(by_time)s::boolean) AS folded;

-- name: heartbeat_messages
-- Extend the leases still held by these (id, token) pairs; returns the ids still owned, each with whether an abort was requested.
-- Rows are locked in id order first, as every statement that waits for message rows locks them.
WITH owned AS MATERIALIZED (
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[])
      AND m.lease_token = ANY (%(tokens)s::uuid[])
    ORDER BY m.id
    FOR UPDATE
)
UPDATE fairqueue_message m
SET lease_expires_at = clock_timestamp() + %(lease)s::interval
FROM owned
WHERE m.id = owned.id
RETURNING m.id, m.abort_requested_at IS NOT NULL;

-- name: complete_messages
-- Settle successful messages: delete them, or keep them as succeeded with their result.
-- The statement is in fairqueue_complete_v1 (planned once per session there).
SELECT id FROM fairqueue_complete_v1(
    %(ids)b::bigint[], %(tokens)b::uuid[], %(results)b::jsonb[], %(runs)b::float8[]
) AS id;

-- name: fail_messages
-- Settle failed attempts: retry after `retry_in` (NULL: no retry) while attempts remain, else dead-letter.
-- Retry times are the database clock plus the delay, the clock the claim compares them with.
-- A message with an abort requested is not retried: it ends aborted. A retry of a unique job
-- (scope 'queued') whose key another message took while it ran is superseded by that message:
-- it ends cancelled rather than queue twice (a unique key is held by one queued message).
-- `runs`: each attempt's run time as its worker measured it (a timed-out attempt: its time
-- limit), recorded in the delta for fairness by time.
WITH t AS MATERIALIZED (
    -- each row's own error, retry time and run time, by its position in the arrays
    SELECT m.id, (%(errors)s::jsonb[])[array_position(%(ids)s::bigint[], m.id)] AS error,
           clock_timestamp()
           + (%(retry_in)s::interval[])[array_position(%(ids)s::bigint[], m.id)] AS retry_at,
           m.attempts >= m.max_attempts AS exhausted,
           m.abort_requested_at IS NOT NULL AS aborted,
           (m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
            AND fairqueue_unique_key_held_v1(m.channel_id, m.unique_key)) AS superseded,
           fairqueue_run_seconds_v1(
               (%(runs)s::float8[])[array_position(%(ids)s::bigint[], m.id)], m.claimed_at) AS run
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[])
      AND m.lease_token = ANY (%(tokens)s::uuid[])
    ORDER BY m.id  -- locked in id order, as every statement that waits for message rows
    FOR UPDATE OF m
), failed AS (
    UPDATE fairqueue_message m
    SET state = CASE
            WHEN t.aborted THEN 'aborted'
            WHEN t.retry_at IS NULL OR t.exhausted THEN 'failed'
            WHEN t.superseded THEN 'cancelled'
            WHEN t.retry_at <= clock_timestamp() THEN 'ready'
            ELSE 'scheduled'
        END,
        run_at = CASE WHEN t.retry_at IS NULL OR t.exhausted OR t.aborted OR t.superseded
                      THEN m.run_at ELSE t.retry_at END,
        finished_at = CASE WHEN t.retry_at IS NULL OR t.exhausted OR t.aborted OR t.superseded
                           THEN clock_timestamp() END,
        last_error = t.error,
        lease_token = NULL,
        lease_expires_at = NULL
    FROM t
    -- join on t alone: adding `m.id = ANY(ids)` here made the planner repeat the whole
    -- ANY lookup per row of t (5,050 index probes for 100 rows)
    WHERE m.id = t.id
    RETURNING m.id, m.channel_id, m.state, t.run,
              -- a unique job back in the queue: no running holder of scope 'active' meanwhile
              -- (a unique violation if there is one: the caller runs the statement again)
              CASE WHEN m.unique_key IS NOT NULL AND m.state IN ('ready', 'scheduled')
                   THEN fairqueue_unique_rejoin_v1(m.channel_id, m.unique_key, m.id, m.unique_scope)
              END AS rejoined
), delta AS (
    INSERT INTO fairqueue_channel_delta (
        channel_id, ready, scheduled, running, failed, run_seconds, run_count
    )
    SELECT channel_id,
           count(*) FILTER (WHERE state = 'ready'),
           count(*) FILTER (WHERE state = 'scheduled'),
           -count(*),
           count(*) FILTER (WHERE state = 'failed'),
           sum(run), count(*)
    FROM failed GROUP BY channel_id
)
SELECT id, state FROM failed;

-- name: release_messages
-- Give claimed messages back unstarted (shutdown): ready again, the attempt not counted.
-- One with an abort requested ends aborted instead, and a unique job whose key was taken
-- while it was claimed (scope 'queued') ends cancelled, superseded (see fail_messages).
-- Nothing ran: the delta gives back the run time the claim charged in advance (run_count
-- with no run_seconds).
WITH t AS MATERIALIZED (
    SELECT m.id,
           m.abort_requested_at IS NOT NULL AS aborted,
           (m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
            AND fairqueue_unique_key_held_v1(m.channel_id, m.unique_key)) AS superseded
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[])
      AND m.lease_token = ANY (%(tokens)s::uuid[])
    ORDER BY m.id  -- locked in id order, as every statement that waits for message rows
    FOR UPDATE OF m
), released AS (
    UPDATE fairqueue_message m
    SET state = CASE WHEN t.aborted THEN 'aborted' WHEN t.superseded THEN 'cancelled'
                     ELSE 'ready' END,
        attempts = greatest(m.attempts - 1, 0), lease_token = NULL,
        lease_expires_at = NULL, worker_id = '',
        finished_at = CASE WHEN t.aborted OR t.superseded THEN clock_timestamp() END
    FROM t
    WHERE m.id = t.id
    RETURNING m.id, m.channel_id, m.state,
              CASE WHEN m.unique_key IS NOT NULL AND m.state = 'ready'  -- see fail_messages
                   THEN fairqueue_unique_rejoin_v1(m.channel_id, m.unique_key, m.id, m.unique_scope)
              END AS rejoined
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, running, run_count)
    SELECT channel_id, count(*) FILTER (WHERE state = 'ready'), -count(*), count(*)
    FROM released GROUP BY channel_id
)
SELECT id FROM released;

-- name: rescue_expired_messages
-- Return messages whose lease expired (worker died or stalled) to ready, or dead-letter them when out of attempts.
-- For fairness by time each is charged the time since its claim, at most `max_charge` seconds
-- (one lease): its worker cannot say how long it ran.
WITH expired AS (
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.state = 'running' AND m.lease_expires_at < clock_timestamp()
    ORDER BY m.lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), rescued AS (
    -- An abort requested: aborted, not requeued. A unique job whose key another message took
    -- while it ran (scope 'queued'): cancelled, superseded (see fail_messages).
    UPDATE fairqueue_message m
    SET state = CASE
            WHEN m.abort_requested_at IS NOT NULL THEN 'aborted'
            WHEN m.attempts >= m.max_attempts THEN 'failed'
            WHEN m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
                 AND fairqueue_unique_key_held_v1(m.channel_id, m.unique_key) THEN 'cancelled'
            ELSE 'ready'
        END,
        finished_at = CASE
            WHEN m.abort_requested_at IS NOT NULL OR m.attempts >= m.max_attempts
                THEN clock_timestamp()
            WHEN m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
                 AND fairqueue_unique_key_held_v1(m.channel_id, m.unique_key) THEN clock_timestamp()
        END,
        last_error = jsonb_build_object(
            'type', 'LeaseExpired',
            -- doubled percent signs: psycopg reads single ones as placeholders
            'message', format('lease held by worker %%s expired at %%s during attempt %%s of %%s',
                              m.worker_id, m.lease_expires_at, m.attempts, m.max_attempts),
            'traceback', NULL),
        lease_token = NULL,
        lease_expires_at = NULL
    WHERE m.id = ANY (ARRAY(SELECT expired.id FROM expired))
    RETURNING m.id, m.channel_id, m.state, m.task_name, m.attempts, m.worker_id,
              least(fairqueue_run_seconds_v1(NULL, m.claimed_at),
                    %(max_charge)s::float8) AS run,
              CASE WHEN m.unique_key IS NOT NULL AND m.state = 'ready'  -- see fail_messages
                   THEN fairqueue_unique_rejoin_v1(m.channel_id, m.unique_key, m.id, m.unique_scope)
              END AS rejoined
), delta AS (
    INSERT INTO fairqueue_channel_delta (
        channel_id, ready, scheduled, running, failed, succeeded, run_seconds, run_count
    )
    SELECT channel_id, count(*) FILTER (WHERE state = 'ready'), 0, -count(*),
           count(*) FILTER (WHERE state = 'failed'), 0, sum(run), count(*)
    FROM rescued GROUP BY channel_id
)
SELECT id, channel_id, state, task_name, attempts, worker_id FROM rescued;

-- name: fold_channel_deltas
-- Fold every pending counter delta into its channel row (maintenance; claims fold what they need).
SELECT fairqueue_fold_deltas_v1(%(limit)s::integer, false, %(by_time)s::boolean) AS folded;

-- name: retry_failed_messages
-- Make failed messages ready again with a fresh attempt budget; idempotent (non-failed rows are untouched).
-- A unique job whose key another message holds now stays failed (that message does its work).
WITH failed AS MATERIALIZED (
    -- locked in id order first, as every statement that waits for message rows
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[]) AND m.state = 'failed'
    ORDER BY m.id
    FOR UPDATE
), retried AS (
    UPDATE fairqueue_message m
    SET state = 'ready', attempts = 0, run_at = clock_timestamp(), finished_at = NULL,
        abort_requested_at = NULL
    FROM failed
    WHERE m.id = failed.id
      AND NOT (m.unique_key IS NOT NULL
               AND fairqueue_unique_key_held_v1(m.channel_id, m.unique_key))
    RETURNING m.id, m.channel_id,
              -- see fail_messages; one of scope 'active' takes its key's hold row again
              CASE WHEN m.unique_key IS NOT NULL
                   THEN fairqueue_unique_rejoin_v1(m.channel_id, m.unique_key, m.id, m.unique_scope)
              END AS rejoined
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id, count(*), 0, 0, -count(*), 0 FROM retried GROUP BY channel_id
)
SELECT id FROM retried;

-- name: select_failed_message_ids
-- Ids of failed messages, oldest first, optionally of one channel; paged by id cursor.
SELECT m.id
FROM fairqueue_message m
WHERE m.state = 'failed'
  AND (%(channel_id)s::bigint IS NULL OR m.channel_id = %(channel_id)s::bigint)
  AND m.id > %(after_id)s::bigint
ORDER BY m.id
LIMIT %(limit)s;

-- name: cancel_messages
-- Cancel waiting (ready or scheduled) messages; running ones are left to finish.
WITH cancelled AS (
    UPDATE fairqueue_message m
    SET state = 'cancelled', finished_at = clock_timestamp()
    FROM (
        -- the state before the update, for the counters
        SELECT o.id, o.state AS old_state
        FROM fairqueue_message o
        WHERE o.id = ANY (%(ids)s::bigint[]) AND o.state IN ('ready', 'scheduled')
        FOR UPDATE SKIP LOCKED
    ) o
    WHERE m.id = o.id AND m.id = ANY (%(ids)s::bigint[])
    RETURNING m.id, m.channel_id, o.old_state
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id,
           -count(*) FILTER (WHERE old_state = 'ready'),
           -count(*) FILTER (WHERE old_state = 'scheduled'),
           0, 0, 0
    FROM cancelled GROUP BY channel_id
)
SELECT id FROM cancelled;

-- name: cancel_matching_messages
-- Cancel up to `limit` waiting (ready or scheduled) messages of a channel and/or a task, within a queue if one is given; call until it returns 0.
-- Rows another transaction holds (a claim taking them right now) are skipped, as by cancel_messages.
WITH victims AS (
    SELECT m.id, m.state AS old_state
    FROM fairqueue_message m
    WHERE m.state IN ('ready', 'scheduled')
      AND (%(channel_id)s::bigint IS NULL OR m.channel_id = %(channel_id)s::bigint)
      AND (%(task)s::text IS NULL OR m.task_name = %(task)s::text)
      AND (%(queue)s::text IS NULL OR m.channel_id IN (
          SELECT c.id FROM fairqueue_channel c WHERE c.queue = %(queue)s::text))
    LIMIT %(limit)s::integer
    FOR UPDATE SKIP LOCKED
), cancelled AS (
    UPDATE fairqueue_message m
    SET state = 'cancelled', finished_at = clock_timestamp()
    FROM victims
    WHERE m.id = victims.id
    RETURNING m.id, m.channel_id, victims.old_state
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id,
           -count(*) FILTER (WHERE old_state = 'ready'),
           -count(*) FILTER (WHERE old_state = 'scheduled'),
           0, 0, 0
    FROM cancelled GROUP BY channel_id
)
SELECT id FROM cancelled;

-- name: select_running_message_ids
-- Ids of running messages of a channel and/or a task, within a queue if one is given (for abort by channel, task or queue): fq_message_lease_idx.
SELECT m.id
FROM fairqueue_message m
WHERE m.state = 'running'
  AND (%(channel_id)s::bigint IS NULL OR m.channel_id = %(channel_id)s::bigint)
  AND (%(task)s::text IS NULL OR m.task_name = %(task)s::text)
  AND (%(queue)s::text IS NULL OR m.channel_id IN (
      SELECT c.id FROM fairqueue_channel c WHERE c.queue = %(queue)s::text))
ORDER BY m.id;

-- name: abort_messages
-- Stop messages wherever they are: waiting ones are cancelled, running ones get an abort request (their worker's heartbeat reads it); returns (id, 'cancelled' or 'abort_requested').
-- Waits for a row another transaction holds (a claim taking it, a settlement), then acts on
-- its newest version (FOR UPDATE re-checks it): a message claimed meanwhile gets the request,
-- one settled meanwhile is left alone. Rows are locked in id order, as settlements lock them.
WITH t AS MATERIALIZED (
    SELECT o.id, o.state AS old_state
    FROM fairqueue_message o
    WHERE o.id = ANY (%(ids)s::bigint[]) AND o.state IN ('ready', 'scheduled', 'running')
    ORDER BY o.id
    FOR UPDATE
), stopped AS (
    UPDATE fairqueue_message m
    SET state = CASE WHEN t.old_state = 'running' THEN 'running' ELSE 'cancelled' END,
        finished_at = CASE WHEN t.old_state = 'running' THEN NULL ELSE clock_timestamp() END,
        abort_requested_at = CASE WHEN t.old_state = 'running'
                                  THEN coalesce(m.abort_requested_at, clock_timestamp()) END
    FROM t
    -- and still in the state the lock returned: the update must never apply the running
    -- branch to a row that a concurrent settlement or release has just moved on (the row
    -- is then left alone and reported skipped, as any message that stopped meanwhile)
    WHERE m.id = t.id AND m.state = t.old_state
    RETURNING m.id, m.channel_id, t.old_state
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id,
           -count(*) FILTER (WHERE old_state = 'ready'),
           -count(*) FILTER (WHERE old_state = 'scheduled'),
           0, 0, 0
    FROM stopped WHERE old_state <> 'running' GROUP BY channel_id
)
SELECT id, CASE WHEN old_state = 'running' THEN 'abort_requested' ELSE 'cancelled' END
FROM stopped ORDER BY id;

-- name: settle_aborted_messages
-- Settle attempts that stopped on an abort request (or outran its grace period): aborted, fenced by the lease token; frees each slot once.
WITH owned AS MATERIALIZED (
    -- locked in id order first, as every statement that waits for message rows
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[])
      AND m.lease_token = ANY (%(tokens)s::uuid[])
    ORDER BY m.id
    FOR UPDATE
), aborted AS (
    UPDATE fairqueue_message m
    SET state = 'aborted', finished_at = clock_timestamp(),
        last_error = (%(errors)s::jsonb[])[array_position(%(ids)s::bigint[], m.id)],
        lease_token = NULL, lease_expires_at = NULL
    FROM owned
    WHERE m.id = owned.id
    RETURNING m.id, m.channel_id, fairqueue_run_seconds_v1(NULL, m.claimed_at) AS run
), delta AS (
    -- for fairness by time, charged the time since its claim (the attempt ran until now)
    INSERT INTO fairqueue_channel_delta (channel_id, running, run_seconds, run_count)
    SELECT channel_id, -count(*), sum(run), count(*) FROM aborted GROUP BY channel_id
)
SELECT id FROM aborted;

-- name: delete_messages
-- Delete messages that are not running; returns the ids deleted.
WITH victims AS MATERIALIZED (
    -- locked in id order first, as every statement that waits for message rows
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[]) AND m.state <> 'running'
    ORDER BY m.id
    FOR UPDATE
), deleted AS (
    DELETE FROM fairqueue_message m
    USING victims
    WHERE m.id = victims.id
    RETURNING m.id, m.channel_id, m.state
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id,
           -count(*) FILTER (WHERE state = 'ready'),
           -count(*) FILTER (WHERE state = 'scheduled'),
           0,
           -count(*) FILTER (WHERE state = 'failed'),
           0
    FROM deleted GROUP BY channel_id
)
SELECT id FROM deleted;

-- name: purge_channel_backlog
-- Delete up to `limit` waiting (ready or scheduled) messages of one channel; call until it returns 0.
WITH victims AS (
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.channel_id = %(channel_id)s::bigint AND m.state IN ('ready', 'scheduled')
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM fairqueue_message m
    WHERE m.id = ANY (ARRAY(SELECT victims.id FROM victims)) AND m.state IN ('ready', 'scheduled')
    RETURNING m.channel_id, m.state
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id,
           -count(*) FILTER (WHERE state = 'ready'),
           -count(*) FILTER (WHERE state = 'scheduled'),
           0, 0, 0
    FROM deleted GROUP BY channel_id
)
SELECT count(*) AS purged FROM deleted;

-- name: prune_finished_messages
-- Delete up to `limit` succeeded, cancelled or aborted messages finished before `before`.
WITH victims AS (
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.state IN ('succeeded', 'cancelled', 'aborted')
      AND m.finished_at < %(before)s::timestamptz
    ORDER BY m.finished_at
    LIMIT %(limit)s
)
DELETE FROM fairqueue_message m
WHERE m.id = ANY (ARRAY(SELECT victims.id FROM victims))
  AND m.state IN ('succeeded', 'cancelled', 'aborted')
RETURNING m.id;

-- name: prune_unique_holds
-- Delete up to `limit` hold rows of unique keys (fairqueue_unique_hold) whose message is gone
-- or finished for good (succeeded, cancelled, aborted): they hold nothing and never will again.
-- (A failed message's row stays while the message does: an operator may retry it, and it then
-- holds its key again.) Rows are taken SKIP LOCKED, and only while they still name the message
-- read: an enqueue taking a row over holds it, and a row it took over names its new message.
WITH candidates AS (
    -- a probe of the message table per hold row (a lateral subquery with LIMIT), never a join
    -- over the whole message table
    SELECT h.channel_id, h.unique_key, h.message_id
    FROM fairqueue_unique_hold h
    LEFT JOIN LATERAL (
        SELECT m.state FROM fairqueue_message m WHERE m.id = h.message_id LIMIT 1
    ) m ON true
    WHERE m.state IS NULL OR m.state IN ('succeeded', 'cancelled', 'aborted')
    LIMIT %(limit)s
), locked AS (
    SELECT h.channel_id, h.unique_key
    FROM fairqueue_unique_hold h
    JOIN candidates c
      ON h.channel_id = c.channel_id AND h.unique_key = c.unique_key
     AND h.message_id = c.message_id
    FOR UPDATE OF h SKIP LOCKED
)
DELETE FROM fairqueue_unique_hold h
USING locked
WHERE h.channel_id = locked.channel_id AND h.unique_key = locked.unique_key
RETURNING h.message_id;

-- name: select_channel_counters
-- Channel counters including deltas not yet folded: exact, and bounded by the delta backlog.
SELECT c.id, c.name,
       c.ready_count + coalesce(d.ready, 0) AS ready,
       c.scheduled_count + coalesce(d.scheduled, 0) AS scheduled,
       c.running_count + coalesce(d.running, 0) AS running,
       c.failed_count + coalesce(d.failed, 0) AS failed,
       c.succeeded_total + coalesce(d.succeeded, 0) AS succeeded
FROM fairqueue_channel c
LEFT JOIN LATERAL (
    SELECT sum(x.ready) AS ready, sum(x.scheduled) AS scheduled, sum(x.running) AS running,
           sum(x.failed) AS failed, sum(x.succeeded) AS succeeded
    FROM fairqueue_channel_delta x
    WHERE x.channel_id = c.id
) d ON true
WHERE c.id = ANY (%(ids)s::bigint[])
ORDER BY c.id;

-- name: rearm_group
-- After an operator edits a channel group's limits: a group waiting for a rate limit removed or
-- shortened is due when the new limit says (never later than now).
UPDATE fairqueue_channel_group g
SET next_turn_at = least(g.next_turn_at, greatest(
        statement_timestamp(),
        coalesce(g.last_claimed_at + g.release_interval, '-infinity'::timestamptz)))
WHERE g.id = %(group_id)s::bigint;

-- name: select_group_state
-- Channel groups (of `ids`, or all) with their scheduler state, for operators (status, the
-- admin): ready, running and claimable summed over their channels with the counter changes not
-- folded yet, as select_all_channel_counts shows each channel (the folded sums, which the
-- trigger keeps in step with the channels' folded counters, lag until maintenance folds), and
-- how many channels each has. One pass over each group's channels (fq_channel_group_idx), a
-- probe of fq_delta_channel_idx per channel.
SELECT g.id, g.name::text, g.weight, g.max_concurrency, g.release_interval,
       coalesce(s.ready, 0), coalesce(s.running, 0), coalesce(s.claimable, 0),
       coalesce(s.channels, 0), g.next_turn_at, g.vtime, g.last_claimed_at
FROM fairqueue_channel_group g
LEFT JOIN LATERAL (
    SELECT count(*) AS channels,
           sum(c.ready_count + coalesce(d.ready, 0))::bigint AS ready,
           sum(c.running_count + coalesce(d.running, 0))::bigint AS running,
           count(*) FILTER (
               WHERE c.ready_count + coalesce(d.ready, 0) > 0
                 AND NOT c.paused
                 AND (c.max_concurrency IS NULL
                      OR c.running_count + coalesce(d.running, 0) < c.max_concurrency)
           )::integer AS claimable
    FROM fairqueue_channel c
    LEFT JOIN LATERAL (
        SELECT sum(x.ready) AS ready, sum(x.running) AS running
        FROM fairqueue_channel_delta x
        WHERE x.channel_id = c.id
    ) d ON true
    WHERE c.group_id IS NOT NULL AND c.group_id = g.id
) s ON true
WHERE %(ids)s::bigint[] IS NULL OR g.id = ANY (%(ids)s::bigint[])
ORDER BY g.name;

-- name: select_all_channel_counts
-- Every channel's configuration and counters including deltas not yet folded (admin, status, metrics).
-- One scan of the channel table hash-joined to the deltas summed once per channel: cheaper than a
-- correlated sum per channel row, and bounded by the channels plus the delta backlog.
SELECT c.id, c.name, c.weight, c.paused, c.max_concurrency,
       c.ready_count + coalesce(d.ready, 0),
       c.scheduled_count + coalesce(d.scheduled, 0),
       c.running_count + coalesce(d.running, 0),
       c.failed_count + coalesce(d.failed, 0),
       c.succeeded_total + coalesce(d.succeeded, 0)
FROM fairqueue_channel c
LEFT JOIN (
    SELECT x.channel_id, sum(x.ready)::bigint AS ready, sum(x.scheduled)::bigint AS scheduled,
           sum(x.running)::bigint AS running, sum(x.failed)::bigint AS failed,
           sum(x.succeeded)::bigint AS succeeded
    FROM fairqueue_channel_delta x
    GROUP BY x.channel_id
) d ON d.channel_id = c.id;

-- name: select_channel_window_stats
-- Per channel with statistics since `since`: claimed, succeeded, failed (for good), retried and timed out (of failed and retried) in that window.
-- Reads the rows of the window through fq_stat_minute_idx (or a scan when the window is most
-- of the table): one row per active channel and minute, never the message table.
SELECT s.channel_id, sum(s.claimed)::bigint, sum(s.succeeded)::bigint, sum(s.failed)::bigint,
       sum(s.retried)::bigint, sum(s.timed_out)::bigint
FROM fairqueue_channel_stat s
WHERE s.minute >= %(since)s::timestamptz
GROUP BY s.channel_id;

-- name: select_window_stats_of_channels
-- select_channel_window_stats for the channels of `ids` only (a page of the admin, status).
SELECT s.channel_id, sum(s.claimed)::bigint, sum(s.succeeded)::bigint, sum(s.failed)::bigint,
       sum(s.retried)::bigint, sum(s.timed_out)::bigint
FROM fairqueue_channel_stat s
WHERE s.channel_id = ANY (%(ids)s::bigint[]) AND s.minute >= %(since)s::timestamptz
GROUP BY s.channel_id;

-- name: record_channel_stats
-- Add workers' per-(channel, minute) tallies to fairqueue_channel_stat (upsert, sorted so concurrent flushes cannot deadlock).
-- timed_out counts, of failed and retried, the attempts that ran out of time.
INSERT INTO fairqueue_channel_stat AS s (
    channel_id, minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum,
    wait_ms_max, wait_histogram, run_ms_sum
)
SELECT t.channel_id, t.minute, t.claimed, t.succeeded, t.failed, t.retried, t.timed_out,
       t.wait_ms_sum, t.wait_ms_max, ARRAY(SELECT jsonb_array_elements_text(t.histogram)::integer),
       t.run_ms_sum
FROM unnest(%(channel_ids)s::bigint[], %(minutes)s::timestamptz[], %(claimed)s::integer[],
            %(succeeded)s::integer[], %(failed)s::integer[], %(retried)s::integer[],
            %(timed_out)s::integer[], %(wait_ms_sum)s::bigint[], %(wait_ms_max)s::integer[],
            %(histograms)s::jsonb[], %(run_ms_sum)s::bigint[])
     AS t(channel_id, minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum,
          wait_ms_max, histogram, run_ms_sum)
-- not for a channel deleted since the worker claimed from it: its rows went with it
WHERE EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = t.channel_id)
ORDER BY t.channel_id, t.minute
ON CONFLICT (channel_id, minute) DO UPDATE
SET claimed = s.claimed + EXCLUDED.claimed,
    succeeded = s.succeeded + EXCLUDED.succeeded,
    failed = s.failed + EXCLUDED.failed,
    retried = s.retried + EXCLUDED.retried,
    timed_out = s.timed_out + EXCLUDED.timed_out,
    wait_ms_sum = s.wait_ms_sum + EXCLUDED.wait_ms_sum,
    wait_ms_max = greatest(s.wait_ms_max, EXCLUDED.wait_ms_max),
    wait_histogram = ARRAY(
        SELECT coalesce(a, 0) + coalesce(b, 0)
        FROM unnest(s.wait_histogram, EXCLUDED.wait_histogram) AS h(a, b)
    ),
    run_ms_sum = s.run_ms_sum + EXCLUDED.run_ms_sum;

-- name: record_minute_stats
-- Add the same flush's sums per minute (all its channels together) to fairqueue_minute_stat, in the transaction of record_channel_stats and after it.
-- Lock order: the flush's channel rows first (record_channel_stats, by channel then minute), then
-- these minute rows by minute. Two flushes that meet wait on a channel row before either holds a
-- minute row, or on minute rows taken in one order: no cycle. A minute row is shared by every
-- worker, but held only for the rest of one flush's short transaction.
INSERT INTO fairqueue_minute_stat AS s (
    minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum, wait_ms_max,
    wait_histogram, run_ms_sum
)
SELECT t.minute, t.claimed, t.succeeded, t.failed, t.retried, t.timed_out, t.wait_ms_sum,
       t.wait_ms_max, ARRAY(SELECT jsonb_array_elements_text(t.histogram)::integer), t.run_ms_sum
FROM unnest(%(minutes)s::timestamptz[], %(claimed)s::bigint[], %(succeeded)s::bigint[],
            %(failed)s::bigint[], %(retried)s::bigint[], %(timed_out)s::bigint[],
            %(wait_ms_sum)s::bigint[], %(wait_ms_max)s::integer[], %(histograms)s::jsonb[],
            %(run_ms_sum)s::bigint[])
     AS t(minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum, wait_ms_max,
          histogram, run_ms_sum)
ORDER BY t.minute
ON CONFLICT (minute) DO UPDATE
SET claimed = s.claimed + EXCLUDED.claimed,
    succeeded = s.succeeded + EXCLUDED.succeeded,
    failed = s.failed + EXCLUDED.failed,
    retried = s.retried + EXCLUDED.retried,
    timed_out = s.timed_out + EXCLUDED.timed_out,
    wait_ms_sum = s.wait_ms_sum + EXCLUDED.wait_ms_sum,
    wait_ms_max = greatest(s.wait_ms_max, EXCLUDED.wait_ms_max),
    wait_histogram = ARRAY(
        SELECT coalesce(a, 0) + coalesce(b, 0)
        FROM unnest(s.wait_histogram, EXCLUDED.wait_histogram) AS h(a, b)
    ),
    run_ms_sum = s.run_ms_sum + EXCLUDED.run_ms_sum;

-- name: prune_channel_stats
-- Delete per-minute channel statistics, and their sums per minute, older than `before`.
WITH minutes AS (
    DELETE FROM fairqueue_minute_stat m WHERE m.minute < %(before)s::timestamptz
)
DELETE FROM fairqueue_channel_stat s WHERE s.minute < %(before)s::timestamptz;

-- name: fold_deltas_of_channel
-- Fold one channel's pending deltas now (after an operator changes its limits, so a new cap sees exact counts).
SELECT fairqueue_fold_channel_v1(%(channel_id)s::bigint) AS folded;

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

-- name: lock_channel_names
-- Hold a channel name against enqueues until the transaction ends (deleting the channel).
SELECT pg_advisory_xact_lock(fairqueue_channel_lock_key_v1(), hashtext(n))
FROM unnest(%(names)s::text[]) AS n
ORDER BY n;

-- name: share_channel_name
-- Take a channel name's lock as an enqueue does (shared, to the end of the transaction), before
-- a statement that locks rows a deletion of the channel also locks (a schedule's firing).
SELECT pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), hashtext(%(name)s::text));

-- name: select_channel_ids
-- Channel ids for names (unknown names are absent from the result).
SELECT c.id, c.name FROM fairqueue_channel c WHERE c.name = ANY (%(names)s::text[]);

-- name: select_channel_ids_in_queues
-- Channel rows of channel names in queues (NULL: every queue), with each row's queue and
-- name within it. A worker's channel filters, resolved once a minute: the rows of other
-- queues than the default are named '<queue>' || chr(31) || '<name>' (fairqueue_queue_of_name_v1).
SELECT c.id, c.queue::text, CASE WHEN c.queue = 'default' THEN c.name::text
                                 ELSE substr(c.name, length(c.queue) + 2) END
FROM fairqueue_channel c
WHERE (c.queue = 'default' OR strpos(c.name, chr(31)) > 1)
  AND (%(queues)s::text[] IS NULL OR c.queue = ANY (%(queues)s::text[]))
  AND CASE WHEN c.queue = 'default' THEN c.name::text
           ELSE substr(c.name, length(c.queue) + 2) END = ANY (%(names)s::text[]);

-- name: delete_failed_messages
-- Delete dead letters; ids of messages in any other state are left alone. Returns the ids deleted.
WITH victims AS MATERIALIZED (
    -- locked in id order first, as every statement that waits for message rows
    SELECT m.id
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[]) AND m.state = 'failed'
    ORDER BY m.id
    FOR UPDATE
), deleted AS (
    DELETE FROM fairqueue_message m
    USING victims
    WHERE m.id = victims.id
    RETURNING m.id, m.channel_id
), delta AS (
    -- wake = false: fewer failed messages never makes a channel claimable.
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded, wake)
    SELECT channel_id, 0, 0, 0, -count(*), 0, false FROM deleted GROUP BY channel_id
)
SELECT id FROM deleted;

-- name: listen_wakeups
-- Subscribe a worker's dedicated connection to enqueue wake-ups. LISTEN takes an identifier, not
-- a value: store.listen_wakeups quotes the name with psycopg.sql.Identifier, never formatting it.
LISTEN {channel};

-- name: select_channel_oldest_ready
-- Per channel with ready messages: since when its longest-waiting head of line has been ready.
-- A loose index scan of fq_message_ready_idx (channel_id, priority DESC, id): the first row of
-- each priority level, each found by one LIMIT 1 probe restarted below the previous level, so a
-- channel costs one probe per priority level in use (usually one), never a scan of its backlog.
-- The first row of a level is its oldest message (ids grow with enqueue). "Ready since" is
-- greatest(enqueued_at, run_at): a delayed message or a retry is claimable from its run_at.
SELECT c.id, o.ready_since
FROM unnest(%(ids)s::bigint[]) AS c(id)
CROSS JOIN LATERAL (
    WITH RECURSIVE heads(priority, ready_since) AS (
        (SELECT m.priority, greatest(m.enqueued_at, m.run_at)
         FROM fairqueue_message m
         WHERE m.channel_id = c.id AND m.state = 'ready'
         ORDER BY m.priority DESC, m.id
         LIMIT 1)
        UNION ALL
        SELECT n.priority, n.ready_since
        FROM heads h
        CROSS JOIN LATERAL (
            SELECT m.priority, greatest(m.enqueued_at, m.run_at) AS ready_since
            FROM fairqueue_message m
            WHERE m.channel_id = c.id AND m.state = 'ready' AND m.priority < h.priority
            ORDER BY m.priority DESC, m.id
            LIMIT 1
        ) n
    )
    SELECT min(heads.ready_since) AS ready_since FROM heads
) o
WHERE o.ready_since IS NOT NULL;

-- name: select_backlogged_oldest_ready
-- select_channel_oldest_ready for every channel whose counters (plus pending deltas) say it has ready messages: no list of ids sent.
-- The same loose index scan per channel; the channels are picked here, so a caller ranking every
-- backlogged channel (the admin's sort by oldest ready, its "oldest ready waits over N" filter)
-- neither reads every channel's counters first nor sends them back as a parameter.
SELECT c.id, o.ready_since
FROM fairqueue_channel c
LEFT JOIN (
    SELECT x.channel_id, sum(x.ready) AS ready
    FROM fairqueue_channel_delta x
    GROUP BY x.channel_id
) d ON d.channel_id = c.id
CROSS JOIN LATERAL (
    WITH RECURSIVE heads(priority, ready_since) AS (
        (SELECT m.priority, greatest(m.enqueued_at, m.run_at)
         FROM fairqueue_message m
         WHERE m.channel_id = c.id AND m.state = 'ready'
         ORDER BY m.priority DESC, m.id
         LIMIT 1)
        UNION ALL
        SELECT n.priority, n.ready_since
        FROM heads h
        CROSS JOIN LATERAL (
            SELECT m.priority, greatest(m.enqueued_at, m.run_at) AS ready_since
            FROM fairqueue_message m
            WHERE m.channel_id = c.id AND m.state = 'ready' AND m.priority < h.priority
            ORDER BY m.priority DESC, m.id
            LIMIT 1
        ) n
    )
    SELECT min(heads.ready_since) AS ready_since FROM heads
) o
WHERE c.ready_count + coalesce(d.ready, 0) > 0 AND o.ready_since IS NOT NULL;

-- name: retry_failed_work_batches
-- Put failed work batches back to pending with a fresh attempt budget; idempotent (other states are untouched).
-- The last error is kept for the record; progress restarts, since a batch is redone whole.
-- Their channels get batch_pending back through a counter delta (no channel row is locked).
WITH failed AS MATERIALIZED (
    -- locked in id order first, as every statement that waits for batch rows
    SELECT b.id
    FROM fairqueue_work_batch b
    WHERE b.id = ANY (%(ids)s::bigint[]) AND b.state = 'failed'
    ORDER BY b.id
    FOR UPDATE
), retried AS (
    UPDATE fairqueue_work_batch b
    SET state = 'pending', attempts = 0, run_at = clock_timestamp(), started_at = NULL,
        finished_at = NULL, rows_processed = 0, lease_token = NULL, lease_expires_at = NULL,
        heartbeat_at = NULL, worker_id = ''
    FROM failed
    WHERE b.id = failed.id
    RETURNING b.id, b.channel_id
), flag AS (
    INSERT INTO fairqueue_channel_delta (channel_id, batch_pending)
    SELECT DISTINCT retried.channel_id, true FROM retried
)
SELECT retried.id FROM retried;

-- name: select_next_due
-- Seconds until a claim could take a message (of these channels, or all but the excluded, of
-- these queues or all), if within the horizon; else NULL; zero or less when one is claimable
-- now. Lock-free: what a worker whose claim came back empty asks to decide when to claim
-- again: the next turn of a rate-limited channel that has ready messages and a free slot (for
-- a channel in a group, the later of its own turn and its group's, and only while the group
-- too has a free slot), or the run_at of the next scheduled message (a retry, a delayed
-- message) of a channel not paused. It agrees with fairqueue_claim_v1 on what a claim can
-- take, counting the counter changes not folded yet (the claim folds them first), so a burst
-- worker never waits for work that only other workers' running messages keep from it.
-- Differences of the database's own clock, never compared with the caller's.
WITH horizon AS (
    SELECT clock_timestamp() AS now, clock_timestamp() + %(horizon)s::interval AS until
), group_freed AS (
    -- slots of groups freed by settlements not folded yet (running deltas are never
    -- positive): one pass over the pending deltas, which the fold keeps few
    SELECT gc.group_id, sum(gd.running) AS running
    FROM fairqueue_channel_delta gd
    JOIN fairqueue_channel gc ON gc.id = gd.channel_id
    WHERE gd.running <> 0 AND gc.group_id IS NOT NULL
    GROUP BY gc.group_id
), next_turn AS (
    SELECT min(CASE WHEN g.id IS NULL THEN c.next_turn_at
                    ELSE greatest(c.next_turn_at, gt.at) END) AS at
    FROM fairqueue_channel c
    CROSS JOIN horizon h
    LEFT JOIN LATERAL (
        -- counter changes not folded yet (new messages, freed slots)
        SELECT sum(d.ready) AS ready, sum(d.running) AS running
        FROM fairqueue_channel_delta d
        WHERE d.channel_id = c.id
    ) x ON true
    LEFT JOIN fairqueue_channel_group g ON g.id = c.group_id
    LEFT JOIN LATERAL (
        -- the group's turn: as the fold would set it were the channel made claimable now
        SELECT CASE WHEN g.claimable > 0 THEN g.next_turn_at
                    ELSE least(g.next_turn_at, greatest(h.now, coalesce(
                        g.last_claimed_at + g.release_interval, '-infinity'::timestamptz)))
               END AS at
    ) gt ON g.id IS NOT NULL
    LEFT JOIN group_freed gf ON gf.group_id = g.id
    WHERE NOT c.paused
      AND c.ready_count + coalesce(x.ready, 0) > 0
      AND (c.max_concurrency IS NULL
           OR c.running_count + coalesce(x.running, 0) < c.max_concurrency)
      AND c.next_turn_at <= h.until
      AND (g.id IS NULL
           OR (gt.at <= h.until
               AND (g.max_concurrency IS NULL
                    OR g.running_count + coalesce(gf.running, 0) < g.max_concurrency)))
      AND (%(only)s::bigint[] IS NULL OR c.id = ANY (%(only)s::bigint[]))
      AND (%(exclude)s::bigint[] IS NULL OR NOT (c.id = ANY (%(exclude)s::bigint[])))
      AND (%(queues)s::text[] IS NULL OR c.queue = ANY (%(queues)s::text[]))
), next_scheduled AS (
    -- fq_message_due_idx in run_at order, bounded by the horizon
    SELECT m.run_at AS at
    FROM fairqueue_message m
    JOIN fairqueue_channel c ON c.id = m.channel_id
    CROSS JOIN horizon h
    WHERE m.state = 'scheduled'
      AND m.run_at <= h.until
      AND NOT c.paused
      AND (%(only)s::bigint[] IS NULL OR m.channel_id = ANY (%(only)s::bigint[]))
      AND (%(exclude)s::bigint[] IS NULL OR NOT (m.channel_id = ANY (%(exclude)s::bigint[])))
      AND (%(queues)s::text[] IS NULL OR c.queue = ANY (%(queues)s::text[]))
    ORDER BY m.run_at
    LIMIT 1
)
SELECT extract(epoch FROM least(
           (SELECT at FROM next_turn), (SELECT at FROM next_scheduled)
       ) - (SELECT now FROM horizon))::float8 AS due_in;

-- ---------------------------------------------------------------------------------------------
-- Work batches (django_fairqueue.batches). Design and locking: docs/explanation/work-batches.md.

-- name: ensure_channel
-- The id of a channel, created with the default limits when missing (planning a job names one).
WITH created AS (
    INSERT INTO fairqueue_channel AS c (
        name, max_concurrency, release_interval, weight, paused, max_backlog,
        next_turn_at, turn_used, ready_count, scheduled_count, running_count,
        failed_count, succeeded_total, created_at
    )
    VALUES (%(name)s::text, %(default_max_concurrency)s::integer,
            %(default_release_interval)s::interval, %(default_weight)s::integer, false,
            %(default_max_backlog)s::integer, clock_timestamp(), 0, 0, 0, 0, 0, 0,
            clock_timestamp())
    ON CONFLICT (name) DO NOTHING
    RETURNING c.id
)
SELECT created.id FROM created
UNION ALL
-- this statement's snapshot does not see `created`'s row, so the name appears once
SELECT c.id FROM fairqueue_channel c WHERE c.name = %(name)s::text;

-- name: select_table_column
-- Schema, table and type of `column` for a relation named `table` (optionally `schema`), or nothing if either is missing.
-- The names are matched exactly, as stored (no case folding): planning gets them from a model's
-- db_table or from the caller, and composes them as quoted identifiers.
SELECT n.nspname::text AS schema, c.relname::text AS table, format_type(a.atttypid, a.atttypmod) AS type
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE c.relname = %(table)s::text
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
  AND a.attname = %(column)s::text
  AND (CASE WHEN %(schema)s::text IS NULL THEN pg_table_is_visible(c.oid)
            ELSE n.nspname = %(schema)s::text END);

-- name: lock_plan
-- Serialise planners of one job until the transaction ends (the second appends after the first).
-- 26226: an advisory-lock namespace of its own ("fq" + 1), apart from enqueue's channel locks.
SELECT pg_advisory_xact_lock(26226, hashtext(%(job)s::text));

-- name: select_last_planned_batch
-- The channel and end of a job's last planned batch: planning resumes after it.
SELECT b.channel_id, b.end_id
FROM fairqueue_work_batch b
WHERE b.job_name = %(job)s::text
ORDER BY b.start_id DESC
LIMIT 1;

-- name: walk_id_index
-- Walk a source table's id index from `from`: up to `steps` windows of `size` ids (count, first, last).
-- A recursive CTE of index(-only) scans, each starting after the previous window's last id, so
-- one round trip plans many batches and no id is ever loaded into Python. The table, id column
-- and filter columns (one equality each) are composed by store.py as quoted identifiers; the
-- values are bound. An index on the id column (behind the filter columns, if any) is needed.
WITH RECURSIVE walk(step, n, first_id, last_id) AS (
    SELECT 1, s.n, s.first_id, s.last_id
    FROM (
        SELECT count(*)::bigint AS n, min(x.id)::bigint AS first_id, max(x.id)::bigint AS last_id
        FROM (
            SELECT t.{id} AS id
            FROM {table} t
            WHERE t.{id} >= %(from)s::bigint{filters}
            ORDER BY t.{id}
            LIMIT %(size)s::bigint
        ) x
    ) s
    UNION ALL
    SELECT w.step + 1, s.n, s.first_id, s.last_id
    FROM walk w
    CROSS JOIN LATERAL (
        SELECT count(*)::bigint AS n, min(x.id)::bigint AS first_id, max(x.id)::bigint AS last_id
        FROM (
            SELECT t.{id} AS id
            FROM {table} t
            WHERE t.{id} > w.last_id{filters}
            ORDER BY t.{id}
            LIMIT %(size)s::bigint
        ) x
    ) s
    WHERE w.step < %(steps)s::integer AND w.n = %(size)s::bigint
)
SELECT w.n, w.first_id, w.last_id FROM walk w WHERE w.n > 0 ORDER BY w.step;

-- name: select_id_span
-- Lowest and highest id of a source table (under the same filters): the planner's progress scale.
SELECT min(t.{id})::bigint AS low, max(t.{id})::bigint AS high
FROM {table} t
WHERE true{filters};

-- name: insert_planned_batches
-- Planned batches of a job; a range the job already has (same start) is skipped. Returns how many were added.
WITH added AS (
    INSERT INTO fairqueue_work_batch (
        channel_id, job_name, start_id, end_id, row_count, state, run_at, attempts,
        max_attempts, worker_id, created_at, rows_processed
    )
    SELECT %(channel_id)s::bigint, %(job)s::text, r.start_id, r.end_id, r.row_count, 'pending',
           clock_timestamp(), 0, %(max_attempts)s::integer, '', clock_timestamp(), 0
    FROM unnest(%(starts)s::bigint[], %(ends)s::bigint[], %(counts)s::bigint[])
         AS r(start_id, end_id, row_count)
    ORDER BY r.start_id
    ON CONFLICT (job_name, start_id) DO NOTHING
    RETURNING row_count
), flag AS (
    -- unconditional (a claim may have cleared the flag while batches were still being added)
    INSERT INTO fairqueue_channel_delta (channel_id, batch_pending)
    VALUES (%(channel_id)s::bigint, true)
)
SELECT count(*)::integer, coalesce(sum(added.row_count), 0)::bigint FROM added;

-- name: claim_work_batch
-- Claim one batch: fair across channels, under the channel's cap (fairqueue_claim_batch_v1).
SELECT * FROM fairqueue_claim_batch_v1(
    %(worker)s::text, %(lease)s::interval, %(jobs)s::text[], %(job_prefixes)s::text[],
    %(only)s::bigint[], %(exclude)s::bigint[]
);

-- name: heartbeat_work_batch
-- Extend a running batch's lease; no row back means the lease is lost (expired and rescued, or settled).
UPDATE fairqueue_work_batch b
SET heartbeat_at = clock_timestamp(), lease_expires_at = clock_timestamp() + %(lease)s::interval
WHERE b.id = %(id)s::bigint AND b.lease_token = %(token)s::uuid
RETURNING b.lease_expires_at;

-- name: lock_leased_work_batch
-- Lock a batch that still runs under this lease, for the fenced completion; nothing back: lost.
-- Held to commit, so a rescuer (SKIP LOCKED) cannot hand the batch to another worker meanwhile.
SELECT b.id
FROM fairqueue_work_batch b
WHERE b.id = %(id)s::bigint AND b.lease_token = %(token)s::uuid
FOR UPDATE;

-- name: complete_work_batch
-- Mark a batch succeeded under its lease token; returns nothing if the lease was lost.
-- The batch's concurrency slot is freed (a counter delta) only when this statement settled it.
WITH done AS (
    UPDATE fairqueue_work_batch b
    SET state = 'succeeded', finished_at = clock_timestamp(), rows_processed = %(rows)s::bigint,
        lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    WHERE b.id = %(id)s::bigint AND b.lease_token = %(token)s::uuid
    RETURNING b.id, b.channel_id
), slot AS (
    INSERT INTO fairqueue_channel_delta (channel_id, running)
    SELECT done.channel_id, -1 FROM done
)
SELECT done.id FROM done;

-- name: fail_work_batch
-- Record a failed attempt under the lease token: back to pending after `retry_in` (on the
-- database clock), or failed (a dead letter) when the attempts are used up or `final` is set.
-- Returns the new state. The slot is freed and a batch pending again flags its channel, both
-- through a counter delta in the same statement (see the claim's flag clearing).
WITH failed AS (
    UPDATE fairqueue_work_batch b
    SET state = CASE WHEN %(final)s::boolean OR b.attempts >= b.max_attempts
                     THEN 'failed' ELSE 'pending' END,
        run_at = CASE WHEN %(final)s::boolean OR b.attempts >= b.max_attempts
                      THEN b.run_at ELSE clock_timestamp() + %(retry_in)s::interval END,
        finished_at = CASE WHEN %(final)s::boolean OR b.attempts >= b.max_attempts
                           THEN clock_timestamp() END,
        last_error = %(error)s::jsonb,
        lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    WHERE b.id = %(id)s::bigint AND b.lease_token = %(token)s::uuid
    RETURNING b.state, b.channel_id
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, running, batch_pending)
    SELECT failed.channel_id, -1, failed.state = 'pending' FROM failed
)
SELECT failed.state FROM failed;

-- name: release_work_batch
-- Give a running batch back (graceful shutdown) without using up an attempt; lease-guarded.
WITH released AS (
    UPDATE fairqueue_work_batch b
    SET state = 'pending', attempts = greatest(b.attempts - 1, 0), run_at = clock_timestamp(),
        started_at = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL,
        worker_id = ''
    WHERE b.id = %(id)s::bigint AND b.lease_token = %(token)s::uuid
    RETURNING b.id, b.channel_id
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, running, batch_pending)
    SELECT released.channel_id, -1, true FROM released
)
SELECT released.id FROM released;

-- name: rescue_expired_work_batches
-- Batches whose lease expired (a dead or stalled worker) go back to pending after a backoff, or to
-- failed when out of attempts. A batch being completed right now is locked and skipped. Each
-- frees its slot, and channels of batches made pending are flagged, through counter deltas.
WITH expired AS (
    SELECT b.id
    FROM fairqueue_work_batch b
    WHERE b.state = 'running' AND b.lease_expires_at < clock_timestamp()
    ORDER BY b.lease_expires_at
    LIMIT %(limit)s::integer
    FOR UPDATE SKIP LOCKED
), rescued AS (
    UPDATE fairqueue_work_batch b
    SET state = CASE WHEN b.attempts >= b.max_attempts THEN 'failed' ELSE 'pending' END,
        run_at = clock_timestamp()
                 + least(%(backoff_base)s::interval * power(2, greatest(b.attempts - 1, 0)),
                         %(backoff_max)s::interval),
        finished_at = CASE WHEN b.attempts >= b.max_attempts THEN clock_timestamp() END,
        last_error = jsonb_build_object(
            'type', 'LeaseExpired',
            'message', format('worker %%s stopped renewing its lease (attempt %%s of %%s)',
                              b.worker_id, b.attempts, b.max_attempts),
            'traceback', NULL, 'attempt', b.attempts, 'worker', b.worker_id),
        lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    FROM expired
    WHERE b.id = expired.id
    RETURNING b.id, b.job_name, b.state, b.worker_id, b.attempts, b.channel_id
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, running, batch_pending)
    SELECT rescued.channel_id, -count(*), bool_or(rescued.state = 'pending')
    FROM rescued GROUP BY rescued.channel_id
)
SELECT rescued.id, rescued.job_name, rescued.state, rescued.worker_id, rescued.attempts
FROM rescued;

-- name: prune_finished_work_batches
-- Delete the batches of jobs that finished (every batch succeeded) before `before`.
-- Jobs with a failed or unfinished batch are kept whole: dead letters stay inspectable.
DELETE FROM fairqueue_work_batch b
WHERE b.job_name IN (
    SELECT j.job_name
    FROM fairqueue_work_batch j
    GROUP BY j.job_name
    HAVING bool_and(j.state = 'succeeded') AND max(j.finished_at) < %(before)s::timestamptz
);

-- name: delete_failed_work_batches
-- Delete failed batches (dead letters) by id; other states are left alone. Returns the ids deleted.
-- Rows are locked in id order first, as every statement that waits for batch rows.
WITH victims AS MATERIALIZED (
    SELECT b.id
    FROM fairqueue_work_batch b
    WHERE b.id = ANY (%(ids)s::bigint[]) AND b.state = 'failed'
    ORDER BY b.id
    FOR UPDATE
)
DELETE FROM fairqueue_work_batch b
USING victims
WHERE b.id = victims.id
RETURNING b.id;

-- name: select_failed_work_batch_ids
-- Ids of failed batches, of one job or of all.
SELECT b.id
FROM fairqueue_work_batch b
WHERE b.state = 'failed' AND (%(job)s::text IS NULL OR b.job_name = %(job)s::text)
ORDER BY b.id;

-- name: select_job_progress
-- Per job (all, one, or those starting with a prefix): batches and rows by state, timings.
-- One pass over the jobs' batches through fq_batch_job_idx; a job holds thousands of batches
-- at most (a batch is ~100k rows), so this stays a few milliseconds.
SELECT b.job_name::text,
       min(c.name)::text AS channel,
       count(*)::bigint AS batches_total,
       count(*) FILTER (WHERE b.state = 'pending')::bigint AS pending,
       count(*) FILTER (WHERE b.state = 'running')::bigint AS running,
       count(*) FILTER (WHERE b.state = 'succeeded')::bigint AS succeeded,
       count(*) FILTER (WHERE b.state = 'failed')::bigint AS failed,
       coalesce(sum(b.row_count), 0)::bigint AS rows_total,
       coalesce(sum(b.row_count) FILTER (WHERE b.state = 'succeeded'), 0)::bigint AS rows_done,
       coalesce(sum(b.rows_processed) FILTER (WHERE b.state = 'succeeded'), 0)::bigint
           AS rows_written,
       min(b.created_at) AS planned_at,
       min(b.started_at) AS started_at,
       max(b.finished_at) FILTER (WHERE b.state = 'succeeded') AS last_finished_at,
       clock_timestamp() AS now
FROM fairqueue_work_batch b
LEFT JOIN fairqueue_channel c ON c.id = b.channel_id
WHERE (%(job)s::text IS NULL OR b.job_name = %(job)s::text)
  AND (%(prefix)s::text IS NULL OR starts_with(b.job_name, %(prefix)s::text))
GROUP BY b.job_name
ORDER BY b.job_name;

-- ---------------------------------------------------------------------------------------------
-- Worker registry (django_fairqueue.registry)

-- name: register_worker
-- Record a worker process as running (upsert by worker id); expire the leases a previous process with the same id left behind.
-- The registering process has claimed nothing yet, so every running message under its id is an
-- orphan of a predecessor (a supervised slot restarted, a fixed --worker-id reused): its lease
-- is made to expire now, and the rescuer requeues it. Returns how many leases were expired.
WITH registered AS (
    INSERT INTO fairqueue_worker AS w (
        worker_id, host, pid, version, concurrency, channels, exclude_channels, queues, state,
        started_at, heartbeat_at, last_claim_at, running, handled, stopped_at
    )
    VALUES (%(worker_id)s::text, %(host)s::text, %(pid)s::integer, %(version)s::text,
            %(concurrency)s::integer, %(channels)s::jsonb, %(exclude_channels)s::jsonb,
            %(queues)s::jsonb, 'running', clock_timestamp(), clock_timestamp(), NULL, 0, 0, NULL)
    ON CONFLICT (worker_id) DO UPDATE
    SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
        concurrency = EXCLUDED.concurrency, channels = EXCLUDED.channels,
        exclude_channels = EXCLUDED.exclude_channels, queues = EXCLUDED.queues,
        state = 'running',
        started_at = EXCLUDED.started_at, heartbeat_at = EXCLUDED.heartbeat_at,
        last_claim_at = NULL, running = 0, handled = 0, stopped_at = NULL
    RETURNING w.worker_id
), orphaned AS (
    UPDATE fairqueue_message m
    SET lease_expires_at = clock_timestamp()
    WHERE m.state = 'running' AND m.worker_id = %(worker_id)s::text
      AND m.lease_expires_at > clock_timestamp()
    RETURNING m.id
)
SELECT (SELECT count(*) FROM orphaned) AS expired, (SELECT count(*) FROM registered) AS n;

-- name: beat_worker
-- A registered worker's beat: it is alive, runs `running` messages, handled `handled`, claimed last at `last_claim_at`.
-- A worker marked dead that beats again (it was frozen, not killed) is running again; its old
-- leases were expired and its late settlements are fenced by their lease tokens.
UPDATE fairqueue_worker w
SET heartbeat_at = clock_timestamp(), state = 'running', running = %(running)s::integer,
    handled = %(handled)s::bigint,
    last_claim_at = coalesce(%(last_claim_at)s::timestamptz, w.last_claim_at)
WHERE w.worker_id = %(worker_id)s::text;

-- name: deregister_worker
-- A worker stopped gracefully (its leases are settled or released).
UPDATE fairqueue_worker w
SET state = 'stopped', stopped_at = clock_timestamp(), running = 0, handled = %(handled)s::bigint
WHERE w.worker_id = %(worker_id)s::text;

-- name: expire_dead_workers
-- Mark workers silent for longer than `dead_after` dead and expire the leases of the messages they ran; returns each with how many.
-- The rescuer requeues (or dead-letters) those messages in the same maintenance pass.
WITH dead AS (
    UPDATE fairqueue_worker w
    SET state = 'dead', running = 0
    WHERE w.state = 'running'
      AND w.heartbeat_at < clock_timestamp() - %(dead_after)s::interval
    RETURNING w.worker_id, w.host, w.pid,
              extract(epoch FROM clock_timestamp() - w.heartbeat_at)::float8 AS silent
), expired AS (
    UPDATE fairqueue_message m
    SET lease_expires_at = clock_timestamp()
    WHERE m.state = 'running' AND m.lease_expires_at > clock_timestamp()
      AND m.worker_id IN (SELECT dead.worker_id FROM dead)
    RETURNING m.worker_id
)
SELECT dead.worker_id, dead.host, dead.pid, dead.silent,
       (SELECT count(*) FROM expired WHERE expired.worker_id = dead.worker_id)
FROM dead
ORDER BY dead.worker_id;

-- name: prune_workers
-- Forget workers stopped or dead before `before`.
DELETE FROM fairqueue_worker w
WHERE w.state <> 'running' AND w.heartbeat_at < %(before)s::timestamptz;

-- name: select_channel_wait_state
-- What the "why is this waiting" sentence needs of one channel, read lock-free: its limits and exact counters, its turn, how many claimable channels come before it in the round, since when its oldest running message runs, and the messages claimed in the last 5 minutes over all channels.
-- The channels ahead are counted on fq_channel_turn_idx (its predicate repeated word for word):
-- the claimable channels whose turn comes before this one's; by time, on fq_channel_vtime_idx,
-- those whose tag is smaller.
SELECT c.name::text, c.paused, c.max_concurrency, c.release_interval, c.next_turn_at,
       c.ready_count + coalesce(d.ready, 0) AS ready,
       c.running_count + coalesce(d.running, 0) AS running,
       clock_timestamp() AS now,
       CASE WHEN NOT %(by_time)s::boolean THEN
           (SELECT count(*)
            FROM fairqueue_channel o
            WHERE o.ready_count > 0
              AND NOT o.paused
              AND (o.max_concurrency IS NULL OR o.running_count < o.max_concurrency)
              AND (o.next_turn_at, o.id) < (c.next_turn_at, c.id)
              AND o.next_turn_at <= clock_timestamp())
       ELSE  -- fairness by time: the claimable channels of smaller tags (fq_channel_vtime_idx)
           (SELECT count(*)
            FROM fairqueue_channel o
            WHERE o.ready_count > 0
              AND NOT o.paused
              AND (o.max_concurrency IS NULL OR o.running_count < o.max_concurrency)
              AND (o.vtime, o.id) < (c.vtime, c.id)
              AND (o.release_interval = interval '0' OR o.next_turn_at <= clock_timestamp()))
       END AS ahead,
       (SELECT min(m.claimed_at)
        FROM fairqueue_message m
        WHERE m.state = 'running' AND m.channel_id = c.id) AS oldest_running_since,
       (SELECT coalesce(sum(s.claimed), 0)
        FROM fairqueue_channel_stat s
        WHERE s.minute >= date_trunc('minute', clock_timestamp()) - interval '4 minutes')
        AS claimed_recently,
       -- its group's limits, as the claim checks them: the running count with its channels'
       -- settlements not folded yet (fq_channel_group_idx, fq_delta_channel_idx), and its turn
       -- as the fold would set it were the channel made claimable now (select_next_due's rule)
       g.name::text AS group_name, g.max_concurrency AS group_max_concurrency,
       g.running_count + coalesce((
           SELECT sum(gd.running)
           FROM fairqueue_channel gc
           JOIN fairqueue_channel_delta gd ON gd.channel_id = gc.id
           WHERE gc.group_id IS NOT NULL AND gc.group_id = g.id), 0) AS group_running,
       g.release_interval AS group_release_interval,
       CASE WHEN g.claimable > 0 THEN g.next_turn_at
            ELSE least(g.next_turn_at, greatest(clock_timestamp(), coalesce(
                g.last_claimed_at + g.release_interval, '-infinity'::timestamptz)))
       END AS group_next_turn_at
FROM fairqueue_channel c
LEFT JOIN LATERAL (
    SELECT sum(x.ready) AS ready, sum(x.running) AS running
    FROM fairqueue_channel_delta x
    WHERE x.channel_id = c.id
) d ON true
LEFT JOIN fairqueue_channel_group g ON g.id = c.group_id
WHERE c.id = %(channel_id)s::bigint;

-- name: select_messages_ahead
-- Ready messages of a channel that a claim takes before this one (higher priority, or the same and older): fq_message_ready_idx.
SELECT count(*)
FROM fairqueue_message m
WHERE m.channel_id = %(channel_id)s::bigint AND m.state = 'ready'
  AND (m.priority > %(priority)s::smallint
       OR (m.priority = %(priority)s::smallint AND m.id < %(id)s::bigint));

-- name: select_clock
-- The database's clock, for figures computed against its timestamps.
SELECT clock_timestamp();

-- name: select_abort_pending_count
-- Running messages with an abort requested that have not stopped yet: fq_message_lease_idx (running rows only).
SELECT count(*) FROM fairqueue_message m
WHERE m.state = 'running' AND m.abort_requested_at IS NOT NULL;

-- name: select_stale_lease_count
-- Running messages whose lease expired (their worker died or stalled): fq_message_lease_idx.
SELECT count(*) FROM fairqueue_message m
WHERE m.state = 'running' AND m.lease_expires_at < clock_timestamp();

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

-- name: select_channel_retrying
-- Per channel of `ids`: messages waiting out a retry's backoff (scheduled after a failed attempt).
-- A scheduled message with attempts > 0 has run and failed: enqueue and retry_failed_messages
-- start at 0, release_messages gives the attempt back. Walks fq_message_retrying_idx
-- (channel_id, partial: exactly these rows), so delayed messages beside them cost nothing;
-- callers pass the channels whose scheduled counter is positive.
SELECT m.channel_id, count(*)
FROM fairqueue_message m
WHERE m.channel_id = ANY (%(ids)s::bigint[]) AND m.state = 'scheduled' AND m.attempts > 0
GROUP BY m.channel_id;

-- name: select_waking_backlog
-- Whether more than `beyond` waking counter deltas wait: a walk of at most that many entries of
-- fq_delta_wake_idx (a claim folds the oldest thousand itself; a work-batch claim that found
-- nothing folds the rest when there are more, see fold_waking_deltas).
SELECT EXISTS (
    SELECT FROM fairqueue_channel_delta d WHERE d.wake ORDER BY d.id OFFSET %(beyond)s::integer
);

-- name: fold_waking_deltas
-- Fold up to `limit` of the oldest waking counter deltas (those that can make a channel
-- claimable: new work, freed slots, newly pending batches) into their channel rows.
SELECT fairqueue_fold_deltas_v1(%(limit)s::integer, true, %(by_time)s::boolean) AS folded;

-- name: record_worker_supervision
-- What a supervisor knew of a worker's slot when it started the process (restarts, crash loop,
-- last exits), recorded by the worker right after it registered.
UPDATE fairqueue_worker SET supervision = %(supervision)s::jsonb
WHERE worker_id = %(worker_id)s::text;
