-- django-fairqueue's benchmark (`manage.py fairbench`, django_fairqueue.contrib.bench): the
-- statements only the benchmark runs. The queue never runs them.
--
-- Same format as django_fairqueue/sql/queries.sql: each statement starts with
-- `-- name: verb_noun` and a one-line description; db.py loads this file once and has exactly
-- one function per name (tests/test_store_sql.py checks both ways). Parameters are psycopg
-- named placeholders %(name)s, always bound, never formatted in.

-- name: lock_benchmark
-- Session lock held for a whole fairbench run, so two runs never share (and truncate) one database.
-- 26225 is fairqueue_lock_key_v1()'s namespace, spelled out: with --scratch the configured
-- database need not be migrated. Enqueue locks channel ids (>= 0) in it; -1 is never one.
SELECT pg_try_advisory_lock(26225, -1) AS acquired;

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
    fairqueue_schedule, fairqueue_schedule_fire
RESTART IDENTITY;

-- name: analyze_queue_tables
-- Refresh planner statistics of the queue tables after a bulk load (stale ones slow the claim tenfold).
ANALYZE fairqueue_message, fairqueue_channel, fairqueue_channel_delta;

-- name: load_ready_messages
-- Bulk-load `count` ready messages round-robin over `channels` (created if missing), with one counter delta per channel.
-- Message i goes to channels[1 + (i - 1) mod n], so a name listed twice gets twice the share.
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
        max_attempts, keep_result, worker_id
    )
    SELECT t.ids[1 + mod(g - 1, cardinality(t.ids))], %(task)s::text, %(payload)s::jsonb, 0,
           'ready', t.now, t.now, 0, %(max_attempts)s::integer, false, ''
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
