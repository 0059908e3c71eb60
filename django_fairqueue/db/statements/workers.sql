-- django-fairqueue: the worker registry (django_fairqueue.runtime.worker_registry).
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/worker_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: select_worker_holder
-- The process a worker id is registered to, if its row says it runs and it beat within `dead_after`: host, pid, seconds since that beat (on this clock); no row otherwise.
SELECT w.host, w.pid, extract(epoch FROM clock_timestamp() - w.heartbeat_at)::float8
FROM fairqueue_worker w
WHERE w.worker_id = %(worker_id)s::text AND w.state = 'running'
  AND w.heartbeat_at >= clock_timestamp() - %(dead_after)s::interval;

-- name: register_worker
-- Record a worker process as running (upsert by worker id), unless a live process holds the id; returns a row when it did.
-- The row may be taken over when it is stopped or dead, silent for `dead_after`, or held by
-- the process `dead_host`/`dead_pid`, which the caller proved gone (select_worker_holder read
-- it). The condition is judged on the row as it is when this statement writes (two processes
-- registering one id at once: the second sees the first's row, fresh, and is refused).
-- (worker_store.register_worker then expires the leases a previous process with the same id
-- left behind: expire_worker_leases.)
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
    last_claim_at = NULL, running = 0, handled = 0, stopped_at = NULL, wakeups = ''
WHERE w.state <> 'running'
   OR w.heartbeat_at < clock_timestamp() - %(dead_after)s::interval
   OR (w.host = %(dead_host)s::text AND w.pid = %(dead_pid)s::integer)
RETURNING w.worker_id;

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
-- A worker stopped, with its last counts (a worker that stops before its first beat has reported nothing else).
UPDATE fairqueue_worker w
SET state = 'stopped', stopped_at = clock_timestamp(), running = 0, handled = %(handled)s::bigint,
    last_claim_at = coalesce(%(last_claim_at)s::timestamptz, w.last_claim_at)
WHERE w.worker_id = %(worker_id)s::text;

-- name: expire_worker_leases
-- Expire now the leases of the messages running under a worker id that no live process holds; returns how many.
-- A registering process has claimed nothing yet, so every running message under its id is an
-- orphan of a predecessor (a supervised slot restarted, a fixed --worker-id reused); a stopping
-- one leaves the messages still running past its grace period. The rescuer's next pass
-- requeues them instead of waiting out their leases.
WITH expired AS (
    UPDATE fairqueue_message m
    SET lease_expires_at = clock_timestamp()
    WHERE m.state = 'running' AND m.worker_id = %(worker_id)s::text
      AND m.lease_expires_at > clock_timestamp()
    RETURNING m.id
)
SELECT count(*) FROM expired;

-- name: expire_dead_workers
-- Mark workers silent for longer than `dead_after` dead and expire the leases of the messages they ran; returns each with how many.
-- The rescuer requeues (or dead-letters) those messages in the same maintenance pass.
-- `alive`: the workers of the calling process, alive whatever their row says (never dead by their own pass).
WITH dead AS (
    UPDATE fairqueue_worker w
    SET state = 'dead', running = 0
    WHERE w.state = 'running'
      AND w.heartbeat_at < clock_timestamp() - %(dead_after)s::interval
      AND w.worker_id <> ALL (%(alive)s::text[])
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

-- name: set_worker_wakeups
-- Record how a worker learns of new messages: 'notify' (its LISTEN was seen to work) or 'polling: <why>'.
UPDATE fairqueue_worker w SET wakeups = %(wakeups)s::text WHERE w.worker_id = %(worker_id)s::text;

-- name: set_worker_supervisor
-- Record which supervisor (host:pid; '' for none) started a registered worker process, right
-- after register_worker (the registry row is its own: no other writer touches this column).
UPDATE fairqueue_worker w
SET supervisor = %(supervisor)s::text
WHERE w.worker_id = %(worker_id)s::text;

-- name: record_worker_supervision
-- What a supervisor knew of a worker's slot when it started the process (restarts, crash loop,
-- last exits), recorded by the worker right after it registered.
UPDATE fairqueue_worker SET supervision = %(supervision)s::jsonb
WHERE worker_id = %(worker_id)s::text;
