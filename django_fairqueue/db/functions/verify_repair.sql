-- django-fairqueue server functions: verify and repair. Counters that disagree with the rows
-- they count and rows whose channel is gone, found and put right.

-- Counters that disagree with the rows they count: for the channels of p_ids (NULL: all), each
-- counter as recorded (the channel's column plus its pending deltas) and as counted from
-- fairqueue_message and fairqueue_work_batch. One statement, so one snapshot: every writer
-- changes rows and counters (or deltas) in one transaction, so a consistent channel reads the
-- same both ways without any lock. running counts running messages and running work batches
-- (one max_concurrency covers both). batch_pending may be true without a pending batch (it
-- means "may have"), never false with one. succeeded_total is a running total of rows that
-- are gone, and cannot be checked.
CREATE OR REPLACE FUNCTION fairqueue_verify_channels_v1(p_ids bigint[])
RETURNS TABLE (channel_id bigint, channel_name text, counter text, recorded bigint,
               actual bigint)
LANGUAGE sql STABLE AS $$
    WITH ch AS (
        SELECT c.id, c.name, c.ready_count, c.scheduled_count, c.running_count, c.failed_count,
               c.batch_pending
        FROM fairqueue_channel c
        WHERE p_ids IS NULL OR c.id = ANY (p_ids)
    ), d AS (
        SELECT x.channel_id, sum(x.ready) AS ready, sum(x.scheduled) AS scheduled,
               sum(x.running) AS running, sum(x.failed) AS failed,
               bool_or(x.batch_pending) AS batches
        FROM fairqueue_channel_delta x
        WHERE p_ids IS NULL OR x.channel_id = ANY (p_ids)
        GROUP BY x.channel_id
    ), m AS (
        SELECT x.channel_id,
               count(*) FILTER (WHERE x.state = 'ready') AS ready,
               count(*) FILTER (WHERE x.state = 'scheduled') AS scheduled,
               count(*) FILTER (WHERE x.state = 'running') AS running,
               count(*) FILTER (WHERE x.state = 'failed') AS failed
        FROM fairqueue_message x
        WHERE x.state IN ('ready', 'scheduled', 'running', 'failed')
          AND (p_ids IS NULL OR x.channel_id = ANY (p_ids))
        GROUP BY x.channel_id
    ), b AS (
        SELECT x.channel_id,
               count(*) FILTER (WHERE x.state = 'running') AS running,
               bool_or(x.state = 'pending') AS pending
        FROM fairqueue_work_batch x
        WHERE x.state IN ('running', 'pending')
          AND (p_ids IS NULL OR x.channel_id = ANY (p_ids))
        GROUP BY x.channel_id
    )
    SELECT ch.id, ch.name::text, v.counter, v.recorded, v.actual
    FROM ch
    LEFT JOIN d ON d.channel_id = ch.id
    LEFT JOIN m ON m.channel_id = ch.id
    LEFT JOIN b ON b.channel_id = ch.id
    CROSS JOIN LATERAL (VALUES
        ('ready', ch.ready_count + coalesce(d.ready, 0), coalesce(m.ready, 0)),
        ('scheduled', ch.scheduled_count + coalesce(d.scheduled, 0), coalesce(m.scheduled, 0)),
        ('running', ch.running_count + coalesce(d.running, 0),
         coalesce(m.running, 0) + coalesce(b.running, 0)),
        ('failed', ch.failed_count + coalesce(d.failed, 0), coalesce(m.failed, 0)),
        ('batch_pending', (ch.batch_pending OR coalesce(d.batches, false))::integer::bigint,
         coalesce(b.pending, false)::integer::bigint)
    ) AS v(counter, recorded, actual)
    WHERE CASE WHEN v.counter = 'batch_pending' THEN v.recorded < v.actual
               ELSE v.recorded <> v.actual END
    ORDER BY ch.id, v.counter
$$;


-- Recount the channels of p_ids from their rows, one at a time in id order, each under its row
-- lock (so no claim changes it meanwhile). Returns what was wrong, as seen under the lock.
-- The pending deltas are deleted and the rows counted in one statement, so one snapshot: a
-- writer that commits meanwhile has both its rows and its delta outside that snapshot, and
-- its delta (not deleted) keeps the counter exact when the fold adds it later. The run times
-- the deleted deltas recorded count nothing the rows can tell: they go back in as deltas of
-- their own (those of messages that ran apart from releases, which ran nothing), for the next
-- fold to correct the channel's tag and mean and its group's tag with, as it would have.
CREATE OR REPLACE FUNCTION fairqueue_repair_channels_v1(p_ids bigint[])
RETURNS TABLE (channel_id bigint, channel_name text, counter text, recorded bigint,
               actual bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
BEGIN
    FOR v_id IN SELECT c.id FROM fairqueue_channel c WHERE c.id = ANY (p_ids) ORDER BY c.id LOOP
        PERFORM FROM fairqueue_channel c WHERE c.id = v_id FOR UPDATE;
        RETURN QUERY SELECT * FROM fairqueue_verify_channels_v1(ARRAY[v_id]);
        WITH gone AS (
            DELETE FROM fairqueue_channel_delta d
            WHERE d.channel_id = v_id
              AND NOT d.drained  -- (a claim's fold takes it: fairqueue_fold_deltas_v1, drained mode)
            RETURNING d.succeeded, d.batch_pending, d.run_seconds, d.run_count
        ), kept AS (
            INSERT INTO fairqueue_channel_delta (channel_id, wake, run_seconds, run_count)
            SELECT v_id, false, sum(gone.run_seconds), sum(gone.run_count)
            FROM gone
            WHERE gone.run_count <> 0 OR gone.run_seconds <> 0
            GROUP BY gone.run_seconds > 0
        ), m AS (
            SELECT count(*) FILTER (WHERE x.state = 'ready') AS ready,
                   count(*) FILTER (WHERE x.state = 'scheduled') AS scheduled,
                   count(*) FILTER (WHERE x.state = 'running') AS running,
                   count(*) FILTER (WHERE x.state = 'failed') AS failed
            FROM fairqueue_message x
            WHERE x.channel_id = v_id AND x.state IN ('ready', 'scheduled', 'running', 'failed')
        ), b AS (
            SELECT count(*) FILTER (WHERE x.state = 'running') AS running,
                   coalesce(bool_or(x.state = 'pending'), false) AS pending
            FROM fairqueue_work_batch x
            WHERE x.channel_id = v_id AND x.state IN ('running', 'pending')
        ), g AS (
            SELECT coalesce(sum(gone.succeeded), 0) AS succeeded,
                   coalesce(bool_or(gone.batch_pending), false) AS batches
            FROM gone
        )
        UPDATE fairqueue_channel c
        SET ready_count = m.ready,
            scheduled_count = m.scheduled,
            running_count = m.running + b.running,
            failed_count = m.failed,
            succeeded_total = c.succeeded_total + g.succeeded,
            batch_pending = c.batch_pending OR g.batches OR b.pending
        FROM m, b, g
        WHERE c.id = v_id;
        -- Counted as its rows say: an enqueue in flight that found the old count wrote a quiet
        -- delta (fairqueue_delta_wakes_v1), which a count of zero must not leave behind.
        INSERT INTO fairqueue_channel_delta (channel_id, wake, drained)
        SELECT v_id, false, true FROM fairqueue_channel c WHERE c.id = v_id AND c.ready_count <= 0
        ON CONFLICT DO NOTHING;  -- (one marker a channel: fq_delta_drained_uniq)
    END LOOP;
END;
$$;


-- Rows whose channel no longer exists, per table. Deleting a channel holds its name against
-- enqueues and deletes its rows in one transaction, so there should be none; a database
-- restored from a partial dump, or rows written by hand, can still have some.
CREATE OR REPLACE FUNCTION fairqueue_verify_orphans_v1()
RETURNS TABLE (tbl text, n bigint)
LANGUAGE sql STABLE AS $$
    SELECT 'fairqueue_message', count(*) FROM fairqueue_message x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id)
    UNION ALL
    SELECT 'fairqueue_channel_delta', count(*) FROM fairqueue_channel_delta x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id)
    UNION ALL
    SELECT 'fairqueue_work_batch', count(*) FROM fairqueue_work_batch x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id)
    UNION ALL
    -- a worker's statistics flush for a channel deleted since it claimed from it
    SELECT 'fairqueue_channel_stat', count(*) FROM fairqueue_channel_stat x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id)
$$;


-- Delete the rows fairqueue_verify_orphans_v1 counts (they would never run: no claim walks a
-- channel that does not exist). Returns how many of each were deleted.
CREATE OR REPLACE FUNCTION fairqueue_repair_orphans_v1()
RETURNS TABLE (tbl text, n bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint;
BEGIN
    DELETE FROM fairqueue_message x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    tbl := 'fairqueue_message'; n := v_n; RETURN NEXT;
    DELETE FROM fairqueue_channel_delta x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    tbl := 'fairqueue_channel_delta'; n := v_n; RETURN NEXT;
    DELETE FROM fairqueue_work_batch x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    tbl := 'fairqueue_work_batch'; n := v_n; RETURN NEXT;
    DELETE FROM fairqueue_channel_stat x
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    tbl := 'fairqueue_channel_stat'; n := v_n; RETURN NEXT;
END;
$$;
