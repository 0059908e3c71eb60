-- django-fairqueue: work batches (django_fairqueue.batches).
-- Design and locking: docs/explanation/work-batches.md.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/batch_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

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
-- and filter columns (one equality each) are composed by batch_store.py as quoted identifiers; the
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

-- name: claim_work_batch prepared
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
