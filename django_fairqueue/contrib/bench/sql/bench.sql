-- django-fairqueue's benchmark (`manage.py fairbench`, django_fairqueue.contrib.bench): the
-- statements only the benchmark runs. The queue never runs them.
--
-- Same format as django_fairqueue/db/statements/*.sql: each statement starts with
-- `-- name: verb_noun` and a one-line description; db.py loads this file once and has exactly
-- one function per name (tests/test_store_sql.py checks both ways). Parameters are psycopg
-- named placeholders %(name)s, always bound, never formatted in.

-- name: lock_benchmark
-- Session lock held for a whole fairbench run, so two runs never share (and truncate) one database.
-- 26225 is fairqueue_lock_key_v1()'s namespace, spelled out: with --scratch the configured
-- database need not be migrated. The bounded-backlog check locks stripes of channel ids (0-127)
-- in it; the slot is -1 for a run in this database, -2 for one in its scratch database: never
-- a stripe.
SELECT pg_try_advisory_lock(26225, %(slot)s) AS acquired;

-- name: hold_old_snapshot
-- fairbench's snapshot scenario: a REPEATABLE READ transaction's first query takes the snapshot
-- it keeps until it ends, holding back the xmin horizon as pg_dump or a session left idle in
-- transaction would. Sent as one simple-protocol string: SET TRANSACTION must come first.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM fairqueue_message;

-- name: select_backend_holds_xmin
-- Whether session `pid` still holds back the xmin horizon (checked before its figures count).
SELECT EXISTS (
    SELECT FROM pg_stat_activity WHERE pid = %(pid)s AND backend_xmin IS NOT NULL
) AS holds;

-- name: enable_function_timing
-- fairbench's functions scenario: count calls and time of PL/pgSQL functions in this session
-- (track_functions is superuser-only; the scenario says so when it is refused).
SELECT set_config('track_functions', 'pl', false) AS track_functions;

-- name: force_stats_flush
-- Make this session's pending statistics visible at the end of this statement (PostgreSQL 15+),
-- rather than up to a second later.
SELECT pg_stat_force_next_flush();

-- name: select_function_times
-- Cumulative calls and milliseconds (with and without nested calls) of the queue's functions,
-- as flushed to the statistics so far; the scenario takes differences.
SELECT f.funcname::text AS name, f.calls, f.total_time, f.self_time
FROM pg_stat_user_functions f
WHERE f.funcname LIKE 'fairqueue\_%%';

-- name: select_index_reads
-- Index entries read so far (pg_stat_user_indexes.idx_tup_read), by index of the queue's
-- tables: dead entries a held snapshot keeps are read too. The snapshot scenario takes
-- differences.
SELECT s.indexrelname::text AS name, s.idx_tup_read
FROM pg_stat_user_indexes s
WHERE s.relname LIKE 'fairqueue\_%%';

-- name: select_queue_tables_in_use
-- Which queue tables hold rows: fairbench refuses a database in use.
SELECT EXISTS (SELECT FROM fairqueue_message) AS messages,
       EXISTS (SELECT FROM fairqueue_channel) AS channels,
       EXISTS (SELECT FROM fairqueue_channel_delta) AS channel_deltas,
       EXISTS (SELECT FROM fairqueue_work_batch) AS work_batches,
       EXISTS (SELECT FROM fairqueue_schedule) AS schedules;

-- name: truncate_queue_tables
-- Empty every queue table and restart its ids (fairbench, on a database it found empty or its scratch database).
TRUNCATE fairqueue_message, fairqueue_channel_delta, fairqueue_channel, fairqueue_work_batch,
    fairqueue_schedule, fairqueue_schedule_fire, fairqueue_channel_group, fairqueue_unique_hold
RESTART IDENTITY;

-- name: analyze_queue_tables
-- Refresh planner statistics of the queue tables after a bulk load (stale ones slow the claim tenfold).
ANALYZE fairqueue_message, fairqueue_channel, fairqueue_channel_delta, fairqueue_channel_group;

-- name: load_ready_messages
-- Bulk-load `count` ready messages round-robin over `channels` (created if missing), with one counter delta per channel.
-- Message i goes to channels[1 + (i - 1) mod n], so a name listed twice gets twice the share.
-- With `unique_scope`, every message is a unique job of that scope with a key of its own.
-- The deltas are computed from that rule rather than from the inserted rows, so a million-row
-- load never aggregates its own RETURNING; the claim (or fold_channel_deltas) folds them.
WITH created AS (
    INSERT INTO fairqueue_channel AS c (
        name, max_concurrency, release_interval, weight, paused, max_backlog,
        next_turn_at, turn_used, ready_count, scheduled_count, running_count,
        failed_count, succeeded_total, created_at
    )
    SELECT n, %(default_max_concurrency)s::integer, %(default_release_interval)s::interval,
           %(default_weight)s::integer, false, %(default_max_backlog)s::integer,
           clock_timestamp(), 0, 0, 0, 0, 0, 0, clock_timestamp()
    FROM (SELECT DISTINCT n FROM unnest(%(channels)s::text[]) AS n) AS names
    ORDER BY n
    ON CONFLICT (name) DO NOTHING
    RETURNING c.id, c.name
), chans AS (
    -- this statement's snapshot does not see `created`'s rows: no name appears twice
    SELECT created.id, created.name FROM created
    UNION ALL
    SELECT c.id, c.name FROM fairqueue_channel c WHERE c.name = ANY (%(channels)s::text[])
), target AS MATERIALIZED (
    SELECT array_agg(chans.id ORDER BY t.ord) AS ids, clock_timestamp() AS now
    FROM unnest(%(channels)s::text[]) WITH ORDINALITY AS t(name, ord)
    JOIN chans ON chans.name = t.name
), inserted AS (
    INSERT INTO fairqueue_message (
        channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
        max_attempts, keep_result, worker_id, unique_key, unique_scope
    )
    SELECT t.ids[1 + mod(g - 1, cardinality(t.ids))], %(task)s::text, %(payload)s::jsonb, 0,
           'ready', t.now, t.now, 0, %(max_attempts)s::integer, false, '',
           CASE WHEN %(unique_scope)s::text IS NOT NULL THEN gen_random_uuid()::text END,
           %(unique_scope)s::text
    FROM target t, generate_series(1, %(count)s::integer) AS g
), delta AS (
    INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
    SELECT t.ids[k],
           %(count)s::integer / cardinality(t.ids)
           + CASE WHEN k <= mod(%(count)s::integer, cardinality(t.ids)) THEN 1 ELSE 0 END,
           0, 0, 0, 0
    FROM target t, generate_subscripts(t.ids, 1) AS k
    WHERE k <= %(count)s::integer
    RETURNING ready
)
SELECT coalesce(sum(delta.ready), 0)::bigint AS loaded FROM delta;

-- name: select_wal_position
-- Where the server writes WAL now (the claim's WAL bytes are measured from here).
SELECT pg_current_wal_insert_lsn()::text;

-- name: select_wal_since
-- Bytes of WAL written since `lsn` (a select_wal_position).
SELECT (pg_current_wal_insert_lsn() - %(lsn)s::pg_lsn)::bigint;

-- name: select_backend_pid
-- The process id of this connection's server backend (its CPU time is read from /proc).
SELECT pg_backend_pid();

-- name: select_server_settings
-- Server settings by name, formatted as SHOW prints them (fairbench records the ones that matter).
SELECT n.name, current_setting(n.name, true) AS value
FROM unnest(%(names)s::text[]) WITH ORDINALITY AS n(name, ord)
ORDER BY n.ord;

-- name: select_database_comment
-- Whether a database exists, and its comment (fairbench marks the scratch databases it creates).
SELECT shobj_description(d.oid, 'pg_database') AS comment
FROM pg_database d
WHERE d.datname = %(name)s::text;

-- name: select_function_digests
-- md5 of each installed fairqueue function's body, to tell runs apart and spot a stale install.
SELECT p.proname::text AS name, md5(p.prosrc) AS digest
FROM pg_proc p
WHERE p.proname LIKE 'fairqueue\_%%' AND p.pronamespace = to_regnamespace(current_schema())
ORDER BY p.proname;

-- name: load_admin_messages
-- Bulk-load messages `start`..`start + count - 1` of an admin benchmark queue of `total` messages over the channels `channel_ids` (round-robin, shifted by one a round).
-- Ids follow enqueue order, so the oldest 60 percent have finished (most succeeded, 1 in 20 failed for
-- good, 1 in 20 cancelled), the next 1 percent run (under leases of 8 workers), and the newest 39 %
-- wait: 3 in 4 ready, 1 in 4 delayed. Task names: 9 common ones and a rare one (1 in 100).
-- Counters are not touched: count_admin_messages writes the deltas after the last chunk.
INSERT INTO fairqueue_message (
    channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
    max_attempts, keep_result, lease_token, lease_expires_at, claimed_at, worker_id,
    finished_at, result, last_error
)
SELECT (%(channel_ids)s::bigint[])[
           1 + mod(g - 1 + (g - 1) / cardinality(%(channel_ids)s::bigint[]),
                   cardinality(%(channel_ids)s::bigint[]))],
       CASE WHEN mod(g, 100) = 0 THEN 'bench.admin.rare_report'
            ELSE 'bench.admin.task_' || mod(g, 9) END,
       jsonb_build_object('args', jsonb_build_array(g), 'kwargs', '{}'::jsonb),
       CASE WHEN mod(g, 50) = 0 THEN 10 ELSE 0 END,
       s.state,
       CASE WHEN s.state = 'scheduled' THEN s.at + interval '1 hour' ELSE s.at END,
       s.at,
       CASE WHEN s.state IN ('ready', 'scheduled') THEN 0 ELSE 1 END,
       CASE WHEN s.state = 'failed' THEN 1 ELSE 3 END,
       s.state = 'succeeded',
       CASE WHEN s.state = 'running' THEN gen_random_uuid() END,
       CASE WHEN s.state = 'running' THEN now() + interval '5 minutes' END,
       CASE WHEN s.state IN ('running', 'succeeded', 'failed') THEN s.at + interval '1 second' END,
       CASE WHEN s.state IN ('ready', 'scheduled') THEN ''
            ELSE 'fairbench-admin-' || mod(g, 8) END,
       CASE WHEN s.state IN ('succeeded', 'failed', 'cancelled') THEN s.at + interval '2 seconds' END,
       CASE WHEN s.state = 'succeeded' THEN jsonb_build_object('ok', g) END,
       CASE WHEN s.state = 'failed' THEN jsonb_build_object(
           'type', 'fairbench.Error', 'message', 'failed on purpose', 'traceback', NULL) END
FROM generate_series(%(start)s::bigint, %(start)s::bigint + %(count)s::bigint - 1) AS g,
LATERAL (
    SELECT CASE
               WHEN g <= %(total)s::bigint * 60 / 100 THEN
                   CASE mod(g, 20) WHEN 0 THEN 'failed' WHEN 1 THEN 'cancelled' ELSE 'succeeded' END
               WHEN g <= %(total)s::bigint * 61 / 100 THEN 'running'
               WHEN mod(g, 4) = 0 THEN 'scheduled'
               ELSE 'ready'
           END AS state,
           -- enqueued over the last day, oldest first
           now() - interval '1 day' * (1 - g::float8 / %(total)s::bigint) AS at
) AS s;

-- name: count_admin_messages
-- One counter delta per channel from the messages loaded by load_admin_messages (the claim or fold_channel_deltas folds them).
INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
SELECT m.channel_id,
       count(*) FILTER (WHERE m.state = 'ready'),
       count(*) FILTER (WHERE m.state = 'scheduled'),
       count(*) FILTER (WHERE m.state = 'running'),
       count(*) FILTER (WHERE m.state = 'failed'),
       count(*) FILTER (WHERE m.state = 'succeeded')
FROM fairqueue_message m
GROUP BY m.channel_id;

-- name: load_admin_workers
-- The 8 workers the admin benchmark's running messages name, registered and beating.
INSERT INTO fairqueue_worker (
    worker_id, host, pid, version, concurrency, channels, exclude_channels, state,
    started_at, heartbeat_at, last_claim_at, running, handled, stopped_at
)
SELECT 'fairbench-admin-' || k, 'bench-host-' || mod(k, 2), 1000 + k, 'bench', 32,
       '[]'::jsonb, '[]'::jsonb, 'running', now() - interval '1 hour', now(), now(), 32,
       100000 + k, NULL
FROM generate_series(0, 7) AS k
ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at, state = 'running';

-- name: delete_admin_workers
-- Remove the admin benchmark's workers from the registry.
DELETE FROM fairqueue_worker WHERE worker_id LIKE 'fairbench-admin-%%';

-- name: load_admin_work_batches
-- One job of `count` work batches over the benchmark's first channel: most succeeded, a few running, failed and pending.
INSERT INTO fairqueue_work_batch (
    channel_id, job_name, start_id, end_id, row_count, state, run_at, attempts, max_attempts,
    lease_token, heartbeat_at, lease_expires_at, worker_id, last_error, created_at, started_at,
    finished_at, rows_processed
)
SELECT %(channel_id)s::bigint, 'fairbench.admin.backfill', (k - 1) * 10000 + 1, k * 10000, 10000,
       s.state, now(), CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END, 3,
       CASE WHEN s.state = 'running' THEN gen_random_uuid() END,
       CASE WHEN s.state = 'running' THEN now() END,
       CASE WHEN s.state = 'running' THEN now() + interval '5 minutes' END,
       CASE WHEN s.state = 'pending' THEN '' ELSE 'fairbench-admin-' || mod(k, 8) END,
       CASE WHEN s.state = 'failed' THEN jsonb_build_object('type', 'fairbench.Error',
           'message', 'failed on purpose') END,
       now() - interval '1 hour',
       CASE WHEN s.state <> 'pending' THEN now() - interval '30 minutes' END,
       CASE WHEN s.state IN ('succeeded', 'failed') THEN now() - interval '10 minutes' END,
       CASE WHEN s.state = 'succeeded' THEN 10000 ELSE 0 END
FROM generate_series(1, %(count)s::integer) AS k,
LATERAL (
    SELECT CASE WHEN k <= %(count)s * 8 / 10 THEN
                CASE WHEN mod(k, 25) = 0 THEN 'failed' ELSE 'succeeded' END
            WHEN k <= %(count)s * 85 / 100 THEN 'running'
            ELSE 'pending' END AS state
) AS s;

-- name: vacuum_queue_tables
-- VACUUM and ANALYZE the message and channel tables after a bulk load, as autovacuum would have done on a queue that old (visibility map set, statistics fresh).
VACUUM (ANALYZE) fairqueue_message, fairqueue_channel;

-- name: make_schedules_due
-- The schedules with ids 1..n due at `slot` (their cron's latest slot), as if it had just come,
-- with their fired slots forgotten (the schedules scenario fires the same slot in every sample).
WITH forgotten AS (
    DELETE FROM fairqueue_schedule_fire f WHERE f.schedule_id <= %(n)s::bigint
)
UPDATE fairqueue_schedule s SET next_fire_at = %(slot)s::timestamptz
WHERE s.id <= %(n)s::bigint;

-- name: analyze_schedules
-- Refresh planner statistics of the schedule tables after the schedules scenario creates them.
ANALYZE fairqueue_schedule, fairqueue_schedule_fire;

-- name: load_admin_usage
-- Usage of every channel for every hour of the last `days` days (what USAGE_RETENTION keeps), and
-- their totals: the admin benchmark's usage pages read the biggest table retention allows.
WITH hours AS (
    SELECT date_trunc('hour', now()) - k * interval '1 hour' AS hour
    FROM generate_series(0, %(days)s::integer * 24 - 1) AS k
), hourly AS (
    INSERT INTO fairqueue_usage (
        hour, channel_id, channel_name, group_name, attempts, succeeded, failures, timeouts,
        worker_ms
    )
    SELECT h.hour, c.id, c.name, '', 60 + mod(c.id, 7), 58 + mod(c.id, 7), 2, mod(c.id, 2),
           (60 + mod(c.id, 7)) * (100 + mod(c.id * 37, 900))
    FROM fairqueue_channel c CROSS JOIN hours h
    ON CONFLICT (hour, channel_id) DO NOTHING
)
INSERT INTO fairqueue_usage_total (channel_id, attempts, succeeded, failures, timeouts, worker_ms)
SELECT c.id, 100000, 99000, 1000, 10, 1000000000 FROM fairqueue_channel c
ON CONFLICT (channel_id) DO NOTHING;

-- name: analyze_admin_usage
-- Planner statistics of the usage tables after load_admin_usage.
VACUUM (ANALYZE) fairqueue_usage, fairqueue_usage_total;

-- name: delete_admin_usage
-- Remove the admin benchmark's usage rows (every row: the benchmark runs on an empty queue).
WITH totals AS (DELETE FROM fairqueue_usage_total)
DELETE FROM fairqueue_usage;
