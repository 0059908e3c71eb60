-- django-fairqueue server functions: work batches. The claim of a work batch.
--
-- Locking rules (docs/explanation/work-batches.md):
--   * The batch claim locks one channel row at a time, FOR NO KEY UPDATE SKIP LOCKED, and writes
--     its batch_turn_* columns and running_count. It never waits for a channel: a channel
--     locked by a message claim or another batch claim is skipped, exactly as message claims
--     skip it.
--   * A channel's max_concurrency covers its running messages and its running work batches
--     together: running_count counts both. The batch claim adds its batch to running_count
--     under the channel row lock, as the message claim adds its messages; every way a batch
--     stops running (completion, failure, release, rescue) records running -1 as a counter
--     delta, as message settlements do. Holding the channel row serialises all claims of that
--     channel, so checking the cap and taking one more is atomic fleet-wide.
--   * A channel group's max_concurrency covers its channels' running messages and batches
--     (its running_count sums theirs). A batch claim of a grouped channel locks the group row
--     after the channel (the lock order's ranks 2 then 3), FOR NO KEY UPDATE SKIP LOCKED: a
--     group held by a message claim (which takes groups before channels, without waiting for
--     a channel) is passed over like a held channel, so the two never wait for each other.
--   * Channel.batch_pending ("may have pending batches") is set through a counter delta
--     (batch_pending true) by every statement that makes a batch pending, in the same
--     transaction, and cleared only by a claim holding the channel row that sees no pending
--     batch (see the comment at the clearing). Nothing but claims, the fold and the repair
--     writes the scheduler's columns of a channel row.
--   * Batch rows are then locked FOR UPDATE SKIP LOCKED; heartbeats, completion, failure and
--     release touch a batch only under its lease token, the rescuer only when its lease expired.

CREATE OR REPLACE FUNCTION fairqueue_claim_batch_v1(
    p_worker text,
    p_lease interval,
    p_jobs text[],          -- exact job names; NULL with p_job_prefixes NULL: any job
    p_job_prefixes text[],  -- job-name prefixes ("enrich:" matches "enrich:alice")
    p_only bigint[],        -- channel ids to serve; NULL: all
    p_exclude bigint[]      -- channel ids never to serve; NULL: none
)
RETURNS TABLE (
    id bigint, channel_id bigint, channel text, job_name text, start_id bigint, end_id bigint,
    row_count bigint, attempts integer, max_attempts integer, lease_token uuid,
    lease_expires_at timestamptz
)
LANGUAGE plpgsql
-- Never a sequential scan (see fairqueue_claim_v1): planned while the delta table looked
-- empty, the probe for waking deltas below read every pending delta on every claim.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_any_job boolean := p_jobs IS NULL AND p_job_prefixes IS NULL;
    v_cur refcursor;
    v_channel record;
    v_group record;
    v_batch bigint;
BEGIN
    -- Fold waking counter deltas first (as the message claim does): freed slots of capped
    -- channels, and batch_pending flags of channels with newly pending batches. Usually there
    -- are none: a probe of their partial index answers that for less than the fold's locking
    -- statement (PL/pgSQL evaluates the EXISTS as an expression).
    IF EXISTS (SELECT FROM fairqueue_channel_delta d WHERE d.wake) THEN
        PERFORM fairqueue_fold_deltas_v1(1000, true);
    END IF;

    -- Channels that may have pending batches, least recently served first: a walk of
    -- fq_channel_batch_turn_idx that stops at the first channel able to give a batch. It passes
    -- over channels at their cap (at most one per running batch, so bounded by the fleet's
    -- size) and channels whose batches wait for a retry time; never over the batches.
    -- An explicit cursor with one FETCH per channel locks channels one by one (a FOR loop
    -- would prefetch, and lock, ten at a time).
    OPEN v_cur FOR
        SELECT c.id, c.name, c.max_concurrency, c.running_count, c.weight, c.batch_turn_used,
               c.group_id
        FROM fairqueue_channel c
        WHERE c.batch_pending AND NOT c.paused
          AND (p_only IS NULL OR c.id = ANY (p_only))
          AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
        ORDER BY c.batch_turn_at, c.id
        FOR NO KEY UPDATE OF c SKIP LOCKED;
    LOOP
        FETCH v_cur INTO v_channel;
        EXIT WHEN NOT FOUND;
        -- The row as locked is the newest version: every claim of this channel (message or
        -- batch) committed before us is counted. Deltas not folded yet only lower the count
        -- (a settlement frees a slot), so this errs on the safe side.
        CONTINUE WHEN v_channel.max_concurrency IS NOT NULL
                      AND v_channel.running_count >= v_channel.max_concurrency;
        IF v_channel.group_id IS NOT NULL THEN
            -- The group's cap, on its row as locked: the newest version, every claim of its
            -- channels committed before us counted (the trigger that keeps its sums runs in
            -- the claims' transactions). Held by another claim: passed over for now.
            SELECT g.max_concurrency, g.running_count INTO v_group
            FROM fairqueue_channel_group g
            WHERE g.id = v_channel.group_id
            FOR NO KEY UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            CONTINUE WHEN v_group.max_concurrency IS NOT NULL
                          AND v_group.running_count >= v_group.max_concurrency;
        END IF;
        SELECT b.id INTO v_batch
        FROM fairqueue_work_batch b
        WHERE b.channel_id = v_channel.id AND b.state = 'pending' AND b.run_at <= v_now
          AND (v_any_job
               OR b.job_name = ANY (p_jobs)
               OR EXISTS (SELECT 1 FROM unnest(p_job_prefixes) AS x(prefix)
                          WHERE starts_with(b.job_name, x.prefix)))
        ORDER BY b.run_at, b.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
        IF v_batch IS NULL THEN
            -- Nothing due here. If nothing is pending at all, take the channel out of the walk.
            -- Whoever makes a batch of it pending again sets the flag in that same transaction,
            -- after our commit (it waits for this row lock), so the flag is never left false
            -- over a pending batch.
            IF NOT EXISTS (SELECT 1 FROM fairqueue_work_batch b
                           WHERE b.channel_id = v_channel.id AND b.state = 'pending') THEN
                UPDATE fairqueue_channel c SET batch_pending = false WHERE c.id = v_channel.id;
            END IF;
            CONTINUE;
        END IF;

        -- Weighted round-robin: a channel keeps its place for `weight` consecutive batches,
        -- then goes to the back of the line.
        UPDATE fairqueue_channel c
        SET batch_turn_at = CASE WHEN v_channel.batch_turn_used + 1 >= v_channel.weight
                                 THEN v_now ELSE c.batch_turn_at END,
            batch_turn_used = CASE WHEN v_channel.batch_turn_used + 1 >= v_channel.weight
                                   THEN 0 ELSE v_channel.batch_turn_used + 1 END,
            running_count = c.running_count + 1
        WHERE c.id = v_channel.id;

        CLOSE v_cur;
        RETURN QUERY
        UPDATE fairqueue_work_batch b
        SET state = 'running',
            attempts = b.attempts + 1,
            lease_token = gen_random_uuid(),
            heartbeat_at = v_now,
            lease_expires_at = v_now + p_lease,
            worker_id = p_worker,
            started_at = v_now,
            finished_at = NULL,
            rows_processed = 0
        WHERE b.id = v_batch
        RETURNING b.id, b.channel_id, v_channel.name::text, b.job_name::text, b.start_id,
                  b.end_id, b.row_count, b.attempts::integer, b.max_attempts::integer,
                  b.lease_token, b.lease_expires_at;
        RETURN;
    END LOOP;
    CLOSE v_cur;
END;
$$;
