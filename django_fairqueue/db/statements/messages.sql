-- django-fairqueue: the statements that claim, settle, rescue and act on messages.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/message_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.
-- Statements that settle a claim (heartbeat, complete, fail, release) match on the lease
-- token, so a claimant whose lease expired and was re-claimed changes nothing. A row has a
-- token exactly while it runs (CHECK fq_message_lease_iff_running), and tokens are random per
-- claim, so `id = ANY(ids) AND lease_token = ANY(tokens)` selects exactly the caller's running
-- rows. They deliberately say nothing about `state`: the planner would answer a state
-- condition with a partial index on running rows and scan all of them (13 ms for 100 rows
-- with 12,000 in flight) instead of 100 primary-key lookups.

-- name: claim_messages prepared
-- Fair claim of up to `limit` messages under fresh leases (see fairqueue_claim_v1).
SELECT id, channel_id, channel_name, task_name, payload, priority, attempts, max_attempts,
       keep_result, lease_token, lease_expires_at, enqueued_at, run_at
FROM fairqueue_claim_v1(
    %(limit)s::integer, %(lease)s::interval, %(worker)s::text, %(only)s::bigint[],
    %(exclude)s::bigint[], %(quantum)s::integer, %(maintain)s::boolean, %(wait_ms)s::integer,
    %(by_time)s::boolean, %(queues)s::text[], %(async_except)s::text[]
);

-- name: prepare_claims
-- The claim's housekeeping on its own: promote due messages, fold waking deltas, and then
-- drained channels' markers (this statement is its transaction: see fairqueue_free_names_v1).
-- (Each fold only when its probe finds something: the fold leaves that probe to its callers.)
SELECT fairqueue_promote_due_v1(clock_timestamp(), 1000) AS promoted,
       CASE WHEN EXISTS (SELECT FROM fairqueue_channel_delta d WHERE d.wake)
            THEN fairqueue_fold_deltas_v1(1000, true, %(by_time)s::boolean) ELSE 0 END
       + CASE WHEN EXISTS (SELECT FROM fairqueue_channel_delta d WHERE d.drained)
              THEN fairqueue_fold_deltas_v1(128, true, %(by_time)s::boolean, true) ELSE 0 END
       AS folded;

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

-- name: complete_messages prepared
-- Settle successful messages: delete them, or keep them as succeeded with their result.
-- The statement is in fairqueue_complete_v1 (planned once per session there). The results
-- come as one JSON array in the order of the ids: the worker encodes a batch's in one call
-- (a jsonb[] parameter cost a Python encoding per message).
SELECT id FROM fairqueue_complete_v1(
    %(ids)b::bigint[], %(tokens)b::uuid[],
    ARRAY(
        SELECT r.value FROM jsonb_array_elements(%(results)b::jsonb) WITH ORDINALITY AS r
        ORDER BY r.ordinality
    ),
    %(runs)b::float8[], %(async_commit)b::boolean
) AS id;

-- name: fail_messages
-- Settle failed attempts: retry after `retry_in` (NULL: no retry) while attempts remain, else dead-letter.
-- Retry times are the database clock plus the delay, the clock the claim compares them with.
-- A message with an abort requested is not retried: it ends aborted. A retry of a unique job
-- (scope 'queued') whose key another message took while it ran is superseded by that message
-- (waiting, or already running: fairqueue_unique_superseded_v1): it ends cancelled rather than
-- run the job twice.
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
            AND fairqueue_unique_superseded_v1(m.channel_id, m.unique_key, m.id)) AS superseded,
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
-- Give claimed messages back unstarted (shutdown) or cut short by the database being unavailable: ready again (after its `delays` entry, when not NULL: scheduled), the attempt not counted.
-- One with an abort requested ends aborted instead, and a unique job whose key was taken
-- while it was claimed (scope 'queued') ends cancelled, superseded (see fail_messages).
-- The attempt did not count: the delta gives back the run time the claim charged in advance
-- (run_count with no run_seconds).
WITH t AS MATERIALIZED (
    SELECT m.id,
           clock_timestamp()
           + (%(delays)s::interval[])[array_position(%(ids)s::bigint[], m.id)] AS run_at,
           m.abort_requested_at IS NOT NULL AS aborted,
           (m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
            AND fairqueue_unique_superseded_v1(m.channel_id, m.unique_key, m.id)) AS superseded
    FROM fairqueue_message m
    WHERE m.id = ANY (%(ids)s::bigint[])
      AND m.lease_token = ANY (%(tokens)s::uuid[])
    ORDER BY m.id  -- locked in id order, as every statement that waits for message rows
    FOR UPDATE OF m
), released AS (
    UPDATE fairqueue_message m
    SET state = CASE WHEN t.aborted THEN 'aborted' WHEN t.superseded THEN 'cancelled'
                     WHEN t.run_at IS NOT NULL THEN 'scheduled' ELSE 'ready' END,
        run_at = CASE WHEN t.run_at IS NOT NULL AND NOT (t.aborted OR t.superseded)
                      THEN t.run_at ELSE m.run_at END,
        attempts = greatest(m.attempts - 1, 0), lease_token = NULL,
        lease_expires_at = NULL, worker_id = '',
        finished_at = CASE WHEN t.aborted OR t.superseded THEN clock_timestamp() END
    FROM t
    WHERE m.id = t.id
    RETURNING m.id, m.channel_id, m.state,
              CASE WHEN m.unique_key IS NOT NULL AND m.state IN ('ready', 'scheduled')
                   THEN fairqueue_unique_rejoin_v1(m.channel_id, m.unique_key, m.id, m.unique_scope)
              END AS rejoined  -- see fail_messages
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, run_count)
    SELECT channel_id, count(*) FILTER (WHERE state = 'ready'),
           count(*) FILTER (WHERE state = 'scheduled'), -count(*), count(*)
    FROM released GROUP BY channel_id
)
SELECT id FROM released;

-- name: rescue_expired_messages
-- Return messages whose lease expired (worker died or stalled) to ready, or dead-letter them when out of attempts.
-- For fairness by time each is charged the time since its claim, at most `max_charge` seconds
-- (one lease): its worker cannot say how long it ran. A message of a task in `at_most_once`
-- (the tasks declared so now) is dead-lettered whatever attempts its row allows: enqueued while
-- the task was at-least-once, it must not run twice once the task is at-most-once.
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
            WHEN m.attempts >= m.max_attempts
                 OR m.task_name = ANY (%(at_most_once)s::text[]) THEN 'failed'
            WHEN m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
                 AND fairqueue_unique_superseded_v1(m.channel_id, m.unique_key, m.id)
                THEN 'cancelled'
            ELSE 'ready'
        END,
        finished_at = CASE
            WHEN m.abort_requested_at IS NOT NULL OR m.attempts >= m.max_attempts
                 OR m.task_name = ANY (%(at_most_once)s::text[])
                THEN clock_timestamp()
            WHEN m.unique_key IS NOT NULL AND m.unique_scope = 'queued'
                 AND fairqueue_unique_superseded_v1(m.channel_id, m.unique_key, m.id)
                THEN clock_timestamp()
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
-- With `channel`, each worker holding a running one is told on it ('fairqueue abort <id>',
-- at commit; PostgreSQL sends identical notifications of a transaction once), so that its
-- heartbeat reads the request at once: a prefetched message is then aborted before it starts.
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
    RETURNING m.id, m.channel_id, t.old_state, m.worker_id
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT channel_id,
           -count(*) FILTER (WHERE old_state = 'ready'),
           -count(*) FILTER (WHERE old_state = 'scheduled'),
           0, 0, 0
    FROM stopped WHERE old_state <> 'running' GROUP BY channel_id
)
SELECT id, CASE WHEN old_state = 'running' THEN 'abort_requested' ELSE 'cancelled' END,
       CASE WHEN old_state = 'running' AND %(channel)s::text IS NOT NULL
            THEN pg_notify(%(channel)s::text, 'fairqueue abort ' || worker_id) END
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
-- a value: message_store.listen_wakeups quotes the name with psycopg.sql.Identifier, never formatting it.
LISTEN {channel};

-- name: select_next_due prepared
-- Seconds until a claim with these filters could take a message, if within the horizon (see
-- the function).
SELECT fairqueue_next_due_v1(
    %(horizon)s::interval, %(rescuing)s::boolean, %(only)s::bigint[], %(exclude)s::bigint[],
    %(queues)s::text[]
);

-- name: select_messages_ahead
-- Ready messages of a channel that a claim takes before this one (higher priority, or the same and older): fq_message_ready_idx.
SELECT count(*)
FROM fairqueue_message m
WHERE m.channel_id = %(channel_id)s::bigint AND m.state = 'ready'
  AND (m.priority > %(priority)s::smallint
       OR (m.priority = %(priority)s::smallint AND m.id < %(id)s::bigint));

-- name: select_abort_pending_count
-- Running messages with an abort requested that have not stopped yet: fq_message_lease_idx (running rows only).
SELECT count(*) FROM fairqueue_message m
WHERE m.state = 'running' AND m.abort_requested_at IS NOT NULL;

-- name: select_stale_lease_count
-- Running messages whose lease expired (their worker died or stalled): fq_message_lease_idx.
SELECT count(*) FROM fairqueue_message m
WHERE m.state = 'running' AND m.lease_expires_at < clock_timestamp();

-- name: notify_probe
-- A wake-up listener's check of itself: a notification on its own channel, from another
-- connection, with a payload only it knows (a worker woken by it only claims once more).
SELECT pg_notify(%(channel)s::text, %(payload)s::text);

-- name: select_expired_leases_by_channel
-- Per channel: running messages whose lease expired (their worker died or stalled), which a
-- live worker's rescuer has not taken back yet. fq_message_lease_idx (running rows only).
SELECT m.channel_id, count(*)
FROM fairqueue_message m
WHERE m.state = 'running' AND m.lease_expires_at < clock_timestamp()
GROUP BY m.channel_id;
