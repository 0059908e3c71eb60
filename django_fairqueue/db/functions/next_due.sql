-- django-fairqueue server functions: the next claim's time. What a worker whose claim came back
-- empty asks before it waits: when could a claim take something.

-- Seconds until a claim could take a message (of these channels, or all but the excluded, of
-- these queues or all), if within the horizon; else NULL; zero or less when one is claimable
-- now. Lock-free: what a worker whose claim came back empty asks to decide when to claim
-- again: the next turn of a rate-limited channel that has ready messages and a free slot (for
-- a channel in a group, the later of its own turn and its group's, and only while the group
-- too has a free slot), or the run_at of the next scheduled message (a retry, a delayed
-- message) of a channel not paused; with p_rescuing (the asking worker runs the rescuer), the
-- expired lease of a running message (its worker died or stalled: the rescuer takes it back,
-- ready again or dead-lettered, and a burst worker must not exit before). It agrees with
-- fairqueue_claim_v1 on what a claim can take, counting the counter changes not folded yet
-- (the claim folds them first), so a burst worker never waits for work that only other
-- workers' running messages keep from it. Differences of the database's own clock, never
-- compared with the caller's.
CREATE OR REPLACE FUNCTION fairqueue_next_due_v1(
    p_horizon interval,
    p_rescuing boolean,
    p_only bigint[],  -- channel ids a claim serves; NULL: all
    p_exclude bigint[],  -- channel ids it never serves; NULL: none
    p_queues text[]  -- the queues it serves; NULL: all
)
RETURNS double precision
LANGUAGE plpgsql
-- Planned once per session, as the claim is (see fairqueue_claim_v1), and never a sequential
-- scan: a plan is kept until a table's next ANALYZE, and one made while the delta table had no
-- pages (autovacuum truncates it after a fold has emptied it) read it whole once per channel
-- with ready messages (10 million rows at 2,000 channels and 5,000 pending deltas), on every
-- empty claim. Planning it afresh instead costs more than running it (1.4 ms against 0.25).
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    RETURN (
        WITH horizon AS (
            SELECT clock_timestamp() AS now, clock_timestamp() + p_horizon AS until
        ), group_freed AS MATERIALIZED (
            -- slots of capped groups freed by settlements not folded yet (running deltas are
            -- never positive): one pass over the pending deltas, which the fold keeps few, and
            -- the group of each that has a running count by its channel's primary key; none
            -- at all without a capped group (a test made once). Computed once, and driven by
            -- the deltas: joined the other way, a plan summed a group's channels once per
            -- channel of the group, and read every delta for each.
            SELECT f.group_id, sum(f.running) AS running
            FROM (
                SELECT (SELECT gc.group_id FROM fairqueue_channel gc
                        WHERE gc.id = gd.channel_id) AS group_id,
                       gd.running
                FROM fairqueue_channel_delta gd
                WHERE gd.running <> 0
                  AND EXISTS (SELECT FROM fairqueue_channel_group cg
                              WHERE cg.max_concurrency IS NOT NULL)
            ) f
            WHERE f.group_id IS NOT NULL
            GROUP BY f.group_id
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
                -- the group's turn: as the fold would set it were the channel made claimable
                -- now (a group with claimable channels is awake)
                SELECT CASE WHEN g.claimable > 0 THEN g.next_turn_at
                            ELSE fairqueue_woken_turn_v1(g.next_turn_at, g.last_claimed_at,
                                                         g.release_interval, h.now)
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
              AND (p_only IS NULL OR c.id = ANY (p_only))
              AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
              AND (p_queues IS NULL OR c.queue = ANY (p_queues))
        ), next_scheduled AS (
            -- fq_message_due_idx in run_at order, bounded by the horizon
            SELECT m.run_at AS at
            FROM fairqueue_message m
            JOIN fairqueue_channel c ON c.id = m.channel_id
            CROSS JOIN horizon h
            WHERE m.state = 'scheduled'
              AND m.run_at <= h.until
              AND NOT c.paused
              AND (p_only IS NULL OR m.channel_id = ANY (p_only))
              AND (p_exclude IS NULL OR NOT (m.channel_id = ANY (p_exclude)))
              AND (p_queues IS NULL OR c.queue = ANY (p_queues))
            ORDER BY m.run_at
            LIMIT 1
        ), expired_lease AS (
            -- fq_message_lease_idx in lease order: only an expired one (a live worker
            -- renews its own)
            SELECT m.lease_expires_at AS at
            FROM fairqueue_message m
            JOIN fairqueue_channel c ON c.id = m.channel_id
            CROSS JOIN horizon h
            WHERE p_rescuing
              AND m.state = 'running'
              AND m.lease_expires_at < h.now
              AND NOT c.paused
              AND (p_only IS NULL OR m.channel_id = ANY (p_only))
              AND (p_exclude IS NULL OR NOT (m.channel_id = ANY (p_exclude)))
              AND (p_queues IS NULL OR c.queue = ANY (p_queues))
            ORDER BY m.lease_expires_at
            LIMIT 1
        )
        SELECT extract(epoch FROM least(
                   (SELECT at FROM next_turn), (SELECT at FROM next_scheduled),
                   (SELECT at FROM expired_lease)
               ) - (SELECT now FROM horizon))::float8 AS due_in
    );
END;
$$;
