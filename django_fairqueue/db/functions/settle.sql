-- django-fairqueue server functions: settlement. The run time a settlement records, and the
-- completion of claimed messages.

-- The run time a settlement records for a message claimed at p_claimed_at: what its worker
-- measured (p_reported, seconds on the worker's monotonic clock), but never more than the
-- database's clock says has passed since the claim, nor less than 0; unreported, the time
-- since the claim. So a worker's wrong clock can neither inflate nor hide a charge beyond
-- what the database saw, and a database clock that stepped back charges nothing negative.
CREATE OR REPLACE FUNCTION fairqueue_run_seconds_v1(
    p_reported double precision, p_claimed_at timestamptz
)
RETURNS double precision
-- VOLATILE (it reads the clock) and one plain expression, so the planner inlines it into the
-- settling statements instead of calling a function per settled message.
LANGUAGE sql VOLATILE AS $$
    SELECT greatest(0, least(
        coalesce(p_reported,
                 extract(epoch FROM clock_timestamp() - p_claimed_at)::double precision, 0),
        coalesce(extract(epoch FROM clock_timestamp() - p_claimed_at)::double precision,
                 p_reported, 0)))
$$;


-- Settle successful messages given as parallel arrays (id, lease token, result): delete them,
-- or keep them as succeeded with their result when the message asked for it. Returns the ids
-- actually settled: a row whose lease token is not the caller's (expired and claimed again,
-- or cancelled) is left alone, and frees no slot.
-- A function rather than a prepared statement for its plan_cache_mode: as a prepared
-- statement it was re-planned on every call (see fairqueue_claim_v1), which cost more server
-- time than the settlement itself for small batches.
-- p_runs: each message's run time in seconds as its worker measured it (NULL: not measured),
-- recorded in the delta for fairness by time (fairqueue_run_seconds_v1 bounds it).
-- p_async_commit (the worker's own settlements, each its own transaction): the transaction
-- commits without waiting for its WAL flush (fairqueue_relax_commit_v1).
CREATE OR REPLACE FUNCTION fairqueue_complete_v1(
    p_ids bigint[],
    p_tokens uuid[],
    p_results jsonb[],
    p_runs double precision[] DEFAULT NULL,
    p_async_commit boolean DEFAULT false
)
RETURNS SETOF bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
-- No sequential scan either (see fairqueue_claim_v1): on a channel table of a few pages the
-- planner prefers one to a primary-key lookup for the wake test below, which runs once per
-- settled channel (25 reads of the whole table for a completion of 100 over 100 channels).
SET enable_seqscan = off
AS $$
BEGIN
    IF p_async_commit THEN
        PERFORM fairqueue_relax_commit_v1();
    END IF;
    -- Lease tokens are random per claim, so "the row's current token is one the caller holds"
    -- is the (id, token) match without a join (a join to unnest() is planned as a nested loop).
    -- Nothing here says `state = 'running'`: a token exists exactly while a row runs (CHECK
    -- fq_message_lease_iff_running), and a state condition would be answered with the partial
    -- index of running rows, scanning all of them instead of primary-key lookups.
    --
    -- Rows are locked in id order first, as every statement that waits for message rows
    -- locks them (the lock order in docs/explanation/fairness.md). Left to itself the statement
    -- below locks in whatever order its plan visits rows (a sequential or bitmap scan: physical
    -- order; and plain rows before kept ones), and an abort() waiting for these rows in id
    -- order, or a heartbeat, deadlocked with it. One row needs no order.
    IF cardinality(p_ids) > 1 THEN
        PERFORM FROM fairqueue_message m
        WHERE m.id = ANY (p_ids) AND m.lease_token = ANY (p_tokens)
        ORDER BY m.id
        FOR UPDATE;
    END IF;
    RETURN QUERY
    WITH gone AS (
        DELETE FROM fairqueue_message m
        WHERE m.id = ANY (p_ids)
          AND m.lease_token = ANY (p_tokens)
          AND NOT m.keep_result
        RETURNING m.id, m.channel_id,
                  fairqueue_run_seconds_v1(p_runs[array_position(p_ids, m.id)], m.claimed_at)
                  AS run
    ), kept AS (
        UPDATE fairqueue_message m
        SET state = 'succeeded',
            result = p_results[array_position(p_ids, m.id)],
            finished_at = clock_timestamp(),
            lease_token = NULL,
            lease_expires_at = NULL
        WHERE m.id = ANY (p_ids)
          AND m.lease_token = ANY (p_tokens)
          AND m.keep_result
        RETURNING m.id, m.channel_id,
                  fairqueue_run_seconds_v1(p_runs[array_position(p_ids, m.id)], m.claimed_at)
                  AS run
    ), settled AS (
        SELECT * FROM gone UNION ALL SELECT * FROM kept
    ), delta AS (
        -- The concurrency slot is freed here, once: only rows this statement settled count.
        -- It wakes the claim only for capped channels (or channels of a capped group), and
        -- for a channel's first settlements (no mean run time yet: by time, the claim charges
        -- such a channel a default estimate until they fold); other channels fold it in
        -- maintenance.
        INSERT INTO fairqueue_channel_delta (
            channel_id, running, succeeded, wake, run_seconds, run_count
        )
        SELECT s.channel_id, -count(*), count(*),
               (SELECT c.max_concurrency IS NOT NULL
                       OR c.mean_run IS NULL
                       OR (c.group_id IS NOT NULL
                           AND (SELECT g.max_concurrency IS NOT NULL
                                FROM fairqueue_channel_group g WHERE g.id = c.group_id))
                FROM fairqueue_channel c WHERE c.id = s.channel_id),
               sum(s.run), count(*)
        FROM settled s GROUP BY s.channel_id
    )
    SELECT settled.id FROM settled;
END;
$$;
