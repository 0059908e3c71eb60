-- django-fairqueue server functions: the claim. The promotion of due scheduled messages, and
-- the fair claim of messages, with and without channel groups (the plan with groups is in
-- plan_grouped.sql).

-- The most a claim may give a channel but for its ready messages: its free slots, one release
-- if it is rate limited or slow-starting (p_by_time: by time, with slow start on; see
-- fairqueue_claim_v1), else the claim's size.
CREATE OR REPLACE FUNCTION fairqueue_claim_cap_v1(
    p_max_concurrency integer, p_running integer, p_release_interval interval,
    p_mean_run double precision, p_by_time boolean, p_limit integer
)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT LEAST(coalesce(p_max_concurrency - p_running, p_limit),
                 CASE WHEN p_release_interval > interval '0' THEN 1
                      WHEN p_by_time AND p_mean_run IS NULL THEN 1
                      ELSE p_limit END)
$$;


-- What of a flow's turn (a channel's or a group's) a claim's walk counts on to cover its batch:
-- what is left of the turn by count; by time the whole turn, as turns only size the walk
-- there (how many flows it locks). Counted as by count, the remainders the merge of start
-- tags leaves made a claim of 100 lock 35 to 46 channels instead of 25, and spread its take
-- over all of them. (What a claim has used is still kept by time, for the queues' order.)
CREATE OR REPLACE FUNCTION fairqueue_turn_left_v1(
    p_turn integer, p_used integer, p_by_time boolean
)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_by_time THEN p_turn ELSE p_turn - p_used END
$$;


-- Move due scheduled messages (delayed enqueues, retries after backoff) to ready.
-- Returns how many were promoted. Bounded by p_limit; concurrent callers skip each other's rows.
CREATE OR REPLACE FUNCTION fairqueue_promote_due_v1(p_now timestamptz, p_limit integer)
RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
DECLARE
    v_count integer;
BEGIN
    -- Almost always nothing is due (the claim calls this only when its own probe found a due
    -- message; the claim's housekeeping statement calls it every time). One probe of
    -- fq_message_due_idx settles that for about a fifth of what the writing statement below
    -- costs even when it writes nothing (measured with track_functions: 68 us of a 181 us
    -- empty claim).
    IF NOT EXISTS (
        SELECT FROM fairqueue_message m WHERE m.state = 'scheduled' AND m.run_at <= p_now
    ) THEN
        RETURN 0;
    END IF;
    WITH due AS (
        SELECT m.id
        FROM fairqueue_message m
        WHERE m.state = 'scheduled' AND m.run_at <= p_now
        ORDER BY m.run_at, m.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), promoted AS (
        UPDATE fairqueue_message m
        SET state = 'ready'
        WHERE m.id = ANY (ARRAY(SELECT due.id FROM due))  -- primary-key lookups
        RETURNING m.channel_id
    ), delta AS (
        INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
        SELECT channel_id, count(*), -count(*), 0, 0, 0
        FROM promoted
        GROUP BY channel_id
        RETURNING ready
    )
    SELECT coalesce(sum(ready), 0) INTO v_count FROM delta;
    RETURN v_count;
END;
$$;


-- The fair claim. Returns up to p_limit messages, spread over channels in round-robin order,
-- each channel within its concurrency cap, rate limit and weight, highest priority first within
-- a channel. Every returned row carries the claim's fresh lease_token (one per claim), which
-- later writes must present.
--
--   1. promote due scheduled messages and fold waking counter deltas (bounded, skip locks;
--      skipped with p_maintain = false);
--   2. lock up to p_limit eligible channels in turn order (index fq_channel_turn_idx):
--      eligible = ready_count > 0, not paused, under its cap, next_turn_at <= now;
--   3. share p_limit among them by weighted water-filling (deficit round-robin in memory);
--      (steps 2 and 3 with channel groups: fairqueue_plan_grouped_v1, when a group is
--      claimable)
--   3b. count the quiet enqueue deltas of channels whose room is all they count
--      (fairqueue_delta_wakes_v1): before step 3, or with groups after it, as a top-up;
--   4. claim each channel's share from fq_message_ready_idx, SKIP LOCKED;
--   5. charge the channels: running_count, ready_count, and the next turn; and the groups
--      of grouped channels: their turn, rate limit and tag; and mark the channels it drains
--      where an enqueue may be in flight (`drained`, folded by step 1 of a later claim).
-- Steps 4 and 5 are one statement, the same with groups and without: a fix to it lands once.
--
-- Cost: steps 2-5 touch only the chosen channels and the rows claimed; nothing scans the
-- backlog, so the cost is flat in the number of queued messages and grows with the number of
-- channels one call serves (at most p_limit).
--
-- p_by_time (fairness by time): step 2 walks fq_channel_vtime_idx instead, smallest virtual
-- tag first, passing over rate-limited channels not due yet (the tag index cannot bound
-- them by time), and step 5 also charges each channel its mean run time per message claimed,
-- divided by its weight. Shares, caps, rate limits and locks are as in turn order. Slow start:
-- a channel with no run time measured yet (a new tenant: mean_run NULL) gets one message at a
-- time until its first settlement folds (its first settlements wake the claim, which folds
-- them), so a tenant of long tasks charged the default estimate cannot take every worker at
-- once; while its first message runs, the walks pass over it (as they do a capped channel).
-- Slow start orders, it never idles a worker: a claim it leaves short serves the slow-starting
-- channels with the rest (the top-up at the end). p_slow_start: true (the callers'), slow
-- start then the top-up; NULL, slow start without the top-up (a queue's part of a claim of
-- several queues, topped up once after all of them); false, no slow start (the top-up).
-- p_token: the lease token to hand out, for the parts of one claim (its queues, its top-up):
-- one token for every message a claim hands out. NULL: a new one.
--
-- p_async_except (the worker's own claims, each its own transaction; NULL otherwise): the
-- transaction commits without waiting for its WAL flush, unless it hands out a message of one
-- of these tasks (the worker's at-most-once tasks): see fairqueue_relax_commit_v1.
CREATE OR REPLACE FUNCTION fairqueue_claim_v1(
    p_limit integer,
    p_lease interval,
    p_worker text,
    p_only bigint[] DEFAULT NULL,
    p_exclude bigint[] DEFAULT NULL,
    p_quantum integer DEFAULT NULL,
    p_maintain boolean DEFAULT true,
    p_wait_ms integer DEFAULT 0,
    p_by_time boolean DEFAULT false,
    p_queues text[] DEFAULT NULL,
    p_async_except text[] DEFAULT NULL,
    p_slow_start boolean DEFAULT true,
    p_token uuid DEFAULT NULL
)
RETURNS TABLE (
    id bigint,
    channel_id bigint,
    channel_name text,
    task_name text,
    payload jsonb,
    priority smallint,
    attempts integer,
    max_attempts integer,
    keep_result boolean,
    lease_token uuid,
    lease_expires_at timestamptz,
    enqueued_at timestamptz,
    run_at timestamptz
)
LANGUAGE plpgsql
-- Plan each statement once per session. PL/pgSQL would otherwise keep re-planning the
-- statements whose parameters are arrays (a custom plan sized for the actual array looks
-- cheaper than the generic one), and planning cost more than running them: server CPU per
-- claim of 1 fell from about 1.6 ms to 0.7 ms. tests/test_explain.py checks the generic plans
-- too: index scans only.
SET plan_cache_mode = force_generic_plan
-- And never a sequential scan. A plan is made from the statistics of its moment and kept until
-- the table's next ANALYZE, and the delta table's say it is nearly empty whenever autovacuum
-- analyzed it just after a fold: the waking probe then read every pending completion's delta
-- on every claim (7,400 rows, half a millisecond of a claim of 100's five), and the charge
-- hashed the whole channel table to update the channels it served.
SET enable_seqscan = off
AS $$
DECLARE
    -- One clock reading for the whole call: the eligibility test, claimed_at and the next turn
    -- all use it, so a rate-limited channel's releases are spaced by at least its interval.
    v_now timestamptz := clock_timestamp();
    -- A channel's turn is weight * quantum messages. The default quantum spreads a full batch
    -- over about 25 channels: enough to stay fair within a batch, few enough that concurrent
    -- claimers still find unlocked channels (a claim of 100 that locked 100 channels left its
    -- peers empty-handed most of the time).
    v_quantum integer := coalesce(p_quantum, greatest(1, p_limit / 25));
    v_cur refcursor;
    r record;
    -- No initial values where the idle poll (which returns before the walk) does not need one:
    -- each is an expression PL/pgSQL prepares again in every transaction, and an array's cast
    -- and expansion besides; they made up a sixth of an idle poll's time in this function. The
    -- walk fills the channel arrays from index 1 (assigning an element of a NULL array makes
    -- it), or fairqueue_plan_grouped_v1 returns them; without groups the group arrays stay NULL,
    -- which step 5 reads as no group.
    v_ids bigint[];
    v_names text[];
    v_turn integer[];
    v_used integer[];
    v_room integer[];
    v_interval interval[];
    v_est double precision[];  -- the tag's charge per message (by time)
    v_tag double precision[];  -- the channels' tags as the walk locked them (by time)
    -- with groups (fairqueue_plan_grouped_v1; NULL without: step 5 then charges no group)
    v_mean double precision[];  -- a channel's charge per message before weights
    v_cg integer[];  -- a channel's group (its index in v_gids), 0: none
    v_gids bigint[];
    v_gused integer[];
    v_gturn integer[];
    v_ginterval interval[];
    v_glast integer[];
    v_gweight integer[];
    v_first_tag double precision;  -- the tag of the first channel the walk locked (by time)
    v_front double precision;  -- the smallest claimable tag plus one charge (by time)
    v_skipped integer;  -- channels locked by the walk and given nothing (by time)
    v_kept_room integer[];
    v_cap integer[];  -- the most each channel may take but for its ready messages
    v_count integer[];  -- the ready messages each counts
    v_short boolean;  -- some channel's share may be all it counts (step 3b)
    v_free bigint[];  -- channels whose names step 3b holds
    v_qids bigint[];  -- of those, the ones it added messages to, and how many
    v_qadded integer[];
    v_k integer;
    v_alloc integer[];
    v_last integer[];  -- when each channel was last given messages in this claim (sequence)
    v_seq integer;
    v_n integer;
    v_covered integer;
    v_left integer;
    v_give integer;
    v_progress boolean;
    v_round integer;
    v_waited boolean;
    v_fold_waited boolean := false;
    v_folding bigint;
    v_wait_until timestamptz;
    v_lock_timeout text;
    v_queue text;  -- the one queue this call walks
    v_queues text[];
    v_lo text;  -- the lowest and highest queues of claimable channels and groups
    v_hi text;
    v_glo text;
    v_ghi text;
    v_no_groups boolean := false;  -- no group is claimable in any queue (p_queues NULL)
    v_grouped boolean := false;  -- a group of v_queue is claimable now
    v_nothing boolean := false;  -- no flow of any queue is claimable (p_queues NULL)
    v_got integer;
    v_probe boolean;  -- the housekeeping's probes to make: scheduled messages due, waking deltas
    v_due boolean := false;
    v_token uuid;  -- the lease token of every message this claim hands out
    v_waking boolean := true;  -- (unknown without housekeeping: as if some were waking)
    v_own boolean;  -- this statement is its own transaction (set after the idle poll's return)
    v_relaxed boolean;  -- true once the commit is relaxed (p_async_except)
    v_rest text[];  -- the queues of the top-up
    v_slow_left boolean;  -- for it: a slow-starting channel could take more
    v_known_left boolean;  -- a channel whose run time is known is claimable still
    i integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'fairqueue: claim limit must be >= 1, got %', p_limit
            USING ERRCODE = '22023';
    END IF;
    IF v_quantum < 1 THEN
        RAISE EXCEPTION 'fairqueue: claim quantum must be >= 1, got %', v_quantum
            USING ERRCODE = '22023';
    END IF;

    -- p_maintain = false skips this housekeeping: a claim inside a caller's long transaction
    -- (exactly-once) must not hold other channels' rows locked until that caller commits; it
    -- runs the same housekeeping in a short transaction of its own first.
    -- Housekeeping only when there is some, and the queues' probe (below) in the same
    -- statement: one statement probes for due scheduled messages and waking deltas (the
    -- probes each function starts with) and, claiming every queue, reads the queues of
    -- claimable flows; a function is called only when its probe found work, and the queues
    -- are read again after it (a fold can make channels claimable). Calling the functions to
    -- find nothing cost more than the probes (each call sets its own plan_cache_mode, the
    -- fold enable_seqscan too, and runs its probe as a statement of its own): an idle poll
    -- was four statements and is one. A column whose CASE is not taken is not computed (its
    -- subquery is an initplan, run when first read). v_waking also tells the idle path below
    -- whether a fold may be in flight.
    v_probe := p_maintain;
    WHILE v_probe OR p_queues IS NULL LOOP
        SELECT q.due, q.waking, q.lo,
               -- the highest queues only when there is a lowest (an idle poll reads two
               -- index entries, not four)
               CASE WHEN q.lo IS NOT NULL THEN (
                   SELECT c.queue::text FROM fairqueue_channel c
                   WHERE c.claimable
                     AND c.group_id IS NULL
                   ORDER BY c.queue DESC LIMIT 1) END,
               q.glo,
               CASE WHEN q.glo IS NOT NULL THEN (
                   SELECT g.queue::text FROM fairqueue_channel_group g
                   WHERE g.claimable > 0
                     AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                   ORDER BY g.queue DESC LIMIT 1) END
        INTO v_due, v_waking, v_lo, v_hi, v_glo, v_ghi
        FROM (
            -- The queues: the lowest (and above, the highest) queue of a claimable flow, the
            -- first and last entries of the two turn indexes, without a lock (see below);
            -- not when the housekeeping is to run first (they are read again after it).
            SELECT x.due, x.waking,
                   CASE WHEN p_queues IS NULL AND NOT (x.due OR x.waking AND v_probe) THEN (
                       SELECT c.queue::text FROM fairqueue_channel c
                       WHERE c.claimable
                         AND c.group_id IS NULL
                       ORDER BY c.queue LIMIT 1) END AS lo,
                   CASE WHEN p_queues IS NULL AND NOT (x.due OR x.waking AND v_probe) THEN (
                       SELECT g.queue::text FROM fairqueue_channel_group g
                       WHERE g.claimable > 0
                         AND (g.max_concurrency IS NULL
                              OR g.running_count < g.max_concurrency)
                       ORDER BY g.queue LIMIT 1) END AS glo
            FROM (
                -- (Each probe in its partial index's order, LIMIT 1: as a bare EXISTS, a
                -- generic plan read the delta table sequentially whenever its statistics
                -- said it was nearly empty, and then read every completion's delta.)
                SELECT CASE WHEN v_probe THEN EXISTS (
                           SELECT FROM fairqueue_message m
                           WHERE m.state = 'scheduled' AND m.run_at <= v_now
                           ORDER BY m.run_at, m.id LIMIT 1)
                            ELSE false END AS due,
                       -- (waking deltas and drained markers: one index, one probe)
                       CASE WHEN v_probe THEN EXISTS (
                           SELECT FROM fairqueue_channel_delta d WHERE d.wake OR d.drained
                           ORDER BY d.id LIMIT 1)
                            ELSE v_waking END AS waking
                OFFSET 0
            ) x
            OFFSET 0  -- (each level computed once: the next one's tests read it)
        ) q;
        EXIT WHEN NOT v_probe OR NOT (v_due OR v_waking);
        IF p_async_except IS NOT NULL THEN  -- (the housekeeping writes: see below)
            PERFORM fairqueue_relax_commit_v1();
            v_relaxed := true;
        END IF;
        IF v_due THEN
            PERFORM fairqueue_promote_due_v1(v_now, 1000);
            v_waking := true;  -- (its deltas wake)
        END IF;
        PERFORM fairqueue_fold_deltas_v1(1000, true, p_by_time);
        -- Drained markers (the probe's, or one a fold of removals just left): their channels'
        -- quiet deltas counted where no enqueue is in flight (a channel brought to zero while
        -- one was keeps its marker, for a later claim).
        IF EXISTS (SELECT FROM fairqueue_channel_delta d WHERE d.drained) THEN
            PERFORM fairqueue_fold_deltas_v1(1000, true, p_by_time, true);
        END IF;
        v_probe := false;  -- (and once more for the queues alone, when claiming every queue)
    END LOOP;

    -- Queues (docs/howto/queues.md). A channel (and a group) belongs to one queue, and the
    -- walks below read one queue's entries only: the indexes they walk lead with `queue`, so
    -- a claim of queue A never reads a channel of queue B. p_queues names the queues this
    -- claim may serve (NULL: all). One queue: walk it. Several: the queues that have a
    -- claimable flow (fairqueue_claimable_queues_v1, two index probes per queue), the one
    -- whose first flow has waited longest first, each claimed in turn by a call of its own
    -- (without waiting for held channels: another queue may have work) until p_limit is met.
    -- None claimable: walk the first queue named, or 'default' (so that CLAIM_WAIT still
    -- waits for a channel a concurrent claim holds or has just folded).
    -- (The claim proper is a block, not indented as one: a claim that comes back short leaves
    -- it, for the top-up of slow-starting channels after it.)
    <<claim>>
    BEGIN
    IF cardinality(p_queues) = 1 THEN
        v_queue := p_queues[1];
    ELSIF p_queues IS NULL THEN
        -- All queues. The housekeeping's statement above read the lowest and highest queue
        -- of a claimable flow. That stands in for the group probe below, so a claim of every
        -- queue runs as many statements as a claim of one: no claimable group at all, and
        -- that probe is skipped. When the queues found agree, that is the one queue with work
        -- (a project with one queue, always), or none has work, and nothing more is read; the
        -- comparisons are PL/pgSQL expressions, not statements.
        v_no_groups := v_glo IS NULL;
        v_nothing := v_lo IS NULL AND v_glo IS NULL;
        v_queue := coalesce(v_lo, v_glo, 'default');
        IF (v_hi IS NOT NULL AND v_hi <> v_queue)
           OR (v_glo IS NOT NULL AND v_glo <> v_queue)
           OR (v_ghi IS NOT NULL AND v_ghi <> v_queue) THEN
            -- Several queues have work. Every queue with a claimable flow, found by skipping
            -- through the two turn indexes from queue to queue (one probe per queue and
            -- index), then served in turn below.
            v_queue := NULL;
            v_no_groups := false;
        END IF;
    ELSE
        v_queues := p_queues;  -- several named (or none: the default queue)
    END IF;
    IF v_queue IS NULL THEN
        IF p_queues IS NULL THEN
            WITH RECURSIVE cq AS (
                (SELECT c.queue::text AS q
                 FROM fairqueue_channel c
                 WHERE c.claimable
                   AND c.group_id IS NULL
                 ORDER BY c.queue
                 LIMIT 1)
                UNION ALL
                SELECT (SELECT c.queue::text
                        FROM fairqueue_channel c
                        WHERE c.claimable
                          AND c.group_id IS NULL
                          AND c.queue > cq.q
                        ORDER BY c.queue
                        LIMIT 1)
                FROM cq WHERE cq.q IS NOT NULL
            ), gq AS (
                (SELECT g.queue::text AS q
                 FROM fairqueue_channel_group g
                 WHERE g.claimable > 0
                   AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                 ORDER BY g.queue
                 LIMIT 1)
                UNION ALL
                SELECT (SELECT g.queue::text
                        FROM fairqueue_channel_group g
                        WHERE g.claimable > 0
                          AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                          AND g.queue > gq.q
                        ORDER BY g.queue
                        LIMIT 1)
                FROM gq WHERE gq.q IS NOT NULL
            )
            SELECT array_agg(DISTINCT x.q) INTO v_queues
            FROM (SELECT cq.q FROM cq UNION ALL SELECT gq.q FROM gq) x
            WHERE x.q IS NOT NULL;
        END IF;
        IF cardinality(v_queues) > 1 THEN  -- which have work, longest waiting first
            SELECT array_agg(q.queue_name ORDER BY q.first_turn, q.queue_name) INTO v_queues
            FROM fairqueue_claimable_queues_v1(v_queues) q;
        END IF;
        IF coalesce(cardinality(v_queues), 0) <= 1 THEN
            v_queue := coalesce(v_queues[1], p_queues[1], 'default');
        ELSE
            v_got := 0;
            v_token := coalesce(p_token, gen_random_uuid());
            FOREACH v_queue IN ARRAY v_queues LOOP
                -- (slow start held in each, and no top-up there: the top-up below serves
                -- them all, after every queue's other channels)
                RETURN QUERY SELECT * FROM fairqueue_claim_v1(
                    p_limit - v_got, p_lease, p_worker, p_only, p_exclude, v_quantum, false, 0,
                    p_by_time, ARRAY[v_queue], p_async_except, NULLIF(p_slow_start, true),
                    v_token);
                GET DIAGNOSTICS v_n = ROW_COUNT;
                v_got := v_got + v_n;
                EXIT WHEN v_got >= p_limit;
            END LOOP;
            EXIT claim;
        END IF;
    END IF;

    -- A claim of every queue that found no claimable flow in any queue (an idle poll): no walk
    -- can find a channel, held or not (a channel a concurrent claim holds is claimable in its
    -- committed version, which the probe read). What a claim that may wait still waits for is
    -- a channel a concurrent claim has just folded (step 2c below, the same statements): wait
    -- for it, then walk its queue once with a new snapshot, without waiting again. Nothing
    -- being folded: nothing to claim.
    IF v_nothing THEN
        -- (no waking delta at the housekeeping's probe a moment ago: none is being folded)
        IF coalesce(p_wait_ms, 0) <= 0 OR NOT v_waking THEN
            RETURN;
        END IF;
        SELECT d.channel_id INTO v_folding
        FROM fairqueue_channel_delta d
        WHERE d.wake
          AND (p_only IS NULL OR d.channel_id = ANY (p_only))
          AND (p_exclude IS NULL OR NOT (d.channel_id = ANY (p_exclude)))
        ORDER BY d.id
        LIMIT 1;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
        SELECT c.queue::text INTO v_queue
        FROM fairqueue_channel c
        WHERE c.id = v_folding
        FOR UPDATE;
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
        v_queue := coalesce(v_queue, 'default');
        v_fold_waited := true;
        v_now := clock_timestamp();
    END IF;

    -- This statement is its own transaction: only such a caller may wait (p_wait_ms,
    -- CLAIM_WAIT) or commit asynchronously (p_async_except). Step 3b holds channel names to
    -- the commit only then (fairqueue_free_names_v1); without, a channel it drains gets a
    -- marker instead, which costs a later claim a fold.
    v_own := coalesce(p_wait_ms, 0) > 0 OR p_async_except IS NOT NULL;
    -- Its commit need not wait for the WAL flush: relaxed here, or by the housekeeping above
    -- if it wrote. Not before the idle poll's return: an idle poll that found no housekeeping
    -- to do writes nothing, so its commit has no flush to wait for, and relaxing it cost a
    -- function call of four statements.
    IF p_async_except IS NOT NULL AND v_relaxed IS NULL THEN
        PERFORM fairqueue_relax_commit_v1();
    END IF;

    -- Channel groups: when a group is claimable now (one probe of fq_group_turn_idx; the
    -- ORDER BY keeps a generic plan on the index, where EXISTS was a sequential scan that
    -- reads every group not claimable), the claim walks groups and ungrouped channels together
    -- (fairqueue_plan_grouped_v1). Without groups, or while none is claimable, the walk below
    -- sees ungrouped channels only (their indexes hold no grouped channel), exactly as before
    -- groups existed. Either way, steps 4 and 5 are the one statement at the end.
    -- (A claim of every queue that found no claimable group skips the probe.)
    IF NOT v_no_groups THEN
        PERFORM FROM fairqueue_channel_group g
        WHERE g.claimable > 0
          AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
          AND g.queue = v_queue
          AND g.next_turn_at <= v_now
        ORDER BY g.next_turn_at, g.id
        LIMIT 1;
        v_grouped := FOUND;
    END IF;
    IF v_grouped THEN
        -- Steps 2 and 3 over the groups and the ungrouped channels together.
        SELECT p.o_now, p.o_ids, p.o_names, p.o_alloc, p.o_used, p.o_turn, p.o_interval,
               p.o_last, p.o_seq, p.o_est, p.o_mean, p.o_cg, p.o_gids, p.o_gused, p.o_gturn,
               p.o_ginterval, p.o_glast, p.o_gweight
        INTO v_now, v_ids, v_names, v_alloc, v_used, v_turn, v_interval, v_last, v_seq, v_est,
             v_mean, v_cg, v_gids, v_gused, v_gturn, v_ginterval, v_glast, v_gweight
        FROM fairqueue_plan_grouped_v1(
            p_limit, p_only, p_exclude, v_quantum, p_wait_ms, p_by_time, v_now, v_queue,
            p_slow_start IS NOT FALSE) p;
        IF v_ids IS NULL THEN
            EXIT claim;
        END IF;
        -- (for step 3b: what the ungrouped channels among them count, and may take but for
        -- that; the plan holds their rows)
        IF array_position(v_cg, 0) IS NOT NULL THEN
            -- (primary-key lookups, placed by array_position: a join to the ids was planned
            -- as a hash join over every channel)
            SELECT array_agg(CASE WHEN v_cg[array_position(v_ids, c.id)] = 0
                                  THEN c.ready_count END
                             ORDER BY array_position(v_ids, c.id)),
                   array_agg(fairqueue_claim_cap_v1(c.max_concurrency, c.running_count,
                                                    c.release_interval, c.mean_run,
                                                    p_by_time AND p_slow_start IS NOT FALSE,
                                                    p_limit)
                             ORDER BY array_position(v_ids, c.id))
            INTO v_count, v_cap
            FROM fairqueue_channel c
            WHERE c.id = ANY (v_ids);
            v_short := true;
        END IF;
    ELSE
        -- Step 2. Walk eligible channels in turn order, locking one per FETCH, and stop as soon as
        -- their shares cover p_limit: a claim locks only the channels it will serve.
        -- The WHERE repeats fq_channel_turn_idx's predicate word for word so the planner can prove
        -- the partial index applies; ORDER BY matches the index (no sort, no backlog scan).
        -- SKIP LOCKED: a channel held by a concurrent claim is skipped, never waited for.
        -- FOR UPDATE re-checks the WHERE on the newest row version, so a cap or turn changed by a
        -- claim that committed after our snapshot is honoured (no lost update).
        --
        -- Step 2b (p_wait_ms > 0 only), the second pass of the loop. Nothing unlocked was
        -- eligible. When that is because concurrent claims hold the eligible channels (one hot
        -- tenant, several claimers), queue behind the first of them in turn order rather than
        -- come back empty: a claim holds a channel only for the rest of its statement and its
        -- commit, and a claimer that came back empty would sleep until its next poll. The wait is
        -- a blocking FOR UPDATE on one channel; it re-checks the WHERE on the row as its holder
        -- left it, passing over a row that is no longer eligible (drained, at its cap, or rate
        -- limited), and that row is then served like a row of the walk. The re-check compares
        -- turns with the clock at that moment, and the clock is read again after the wait: the
        -- holder's claim may have started after our first reading and moved the turn past it.
        -- Bounded by lock_timeout = p_wait_ms: a channel held longer (by a claim inside a
        -- caller's transaction, or a claim slowed down by a long transaction elsewhere) makes
        -- this statement fail with SQLSTATE 55P03; message_store then reports no messages (and
        -- redoes a completion of the same call on its own). So only a caller in a transaction of
        -- its own may wait. No deadlock can last: this transaction's other locks were taken with SKIP
        -- LOCKED or are on its own leased messages, and lock_timeout, far below deadlock_timeout,
        -- ends a wait on a channel locked by another claim's counter fold.
        -- (The walk's counters start here, not in DECLARE: the idle poll never needs them.)
        v_n := 0;
        v_covered := 0;
        v_skipped := 0;
        v_short := false;
        v_waited := false;
        v_seq := 0;
        v_round := 0;
        LOOP
            IF p_by_time AND NOT v_waited THEN
                -- The same walk in tag order. The rate limit is a filter here, not an index
                -- bound: `release_interval = 0 OR` keeps the planner off fq_channel_turn_idx
                -- (a range scan there would have to sort every claimable channel by tag).
                -- `front`, for the check after the walk (below), is read once, without a lock,
                -- by the walk's statement (a subquery run on the first row): a statement of its
                -- own cost about a tenth of a claim of 1. It is read in the walk's snapshot, so
                -- a channel a concurrent claim charged meanwhile may look ahead of its locked
                -- self, and the claim then waits for the smallest tag and serves it alone (a
                -- read after the walk had a narrower window for the same): never more than the
                -- tags allow, at worst a claim of fewer channels.
                OPEN v_cur FOR
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime,
                           CASE WHEN coalesce(p_wait_ms, 0) > 0 THEN (
                               SELECT f.vtime + greatest(coalesce(f.mean_run,
                                                                  fairqueue_default_run_v1()),
                                                         1e-6) / f.weight
                               FROM fairqueue_channel f
                               WHERE f.claimable
                                 AND f.group_id IS NULL
                                 AND f.queue = v_queue
                                 AND (f.release_interval = interval '0' OR f.next_turn_at <= v_now)
                                 AND (f.mean_run IS NOT NULL OR f.running_count = 0
                                      OR p_slow_start IS FALSE)
                                 AND (p_only IS NULL OR f.id = ANY (p_only))
                                 AND (p_exclude IS NULL OR NOT (f.id = ANY (p_exclude)))
                               ORDER BY f.vtime, f.id
                               LIMIT 1) END AS front
                    FROM fairqueue_channel c
                    WHERE c.claimable
                      AND c.group_id IS NULL
                      AND c.queue = v_queue
                      AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
                      AND (c.mean_run IS NOT NULL OR c.running_count = 0  -- not slow-starting
                           OR p_slow_start IS FALSE)
                      AND (p_only IS NULL OR c.id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                    ORDER BY c.vtime, c.id
                    LIMIT p_limit
                    FOR UPDATE SKIP LOCKED;
            ELSIF p_by_time THEN
                OPEN v_cur FOR
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                    FROM fairqueue_channel c
                    WHERE c.claimable
                      AND c.group_id IS NULL
                      AND c.queue = v_queue
                      AND (c.release_interval = interval '0'
                           OR (c.next_turn_at <= v_wait_until
                               AND c.next_turn_at <= clock_timestamp()))
                      AND (c.mean_run IS NOT NULL OR c.running_count = 0  -- not slow-starting
                           OR p_slow_start IS FALSE)
                      AND (p_only IS NULL OR c.id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                    ORDER BY c.vtime, c.id
                    LIMIT 1
                    FOR UPDATE;
            ELSIF NOT v_waited THEN
                OPEN v_cur FOR
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                    FROM fairqueue_channel c
                    WHERE c.claimable
                      AND c.group_id IS NULL
                      AND c.queue = v_queue
                      AND c.next_turn_at <= v_now
                      AND (p_only IS NULL OR c.id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                    ORDER BY c.next_turn_at, c.id
                    LIMIT p_limit
                    FOR UPDATE SKIP LOCKED;
            ELSE
                OPEN v_cur FOR
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                    FROM fairqueue_channel c
                    WHERE c.claimable
                      AND c.group_id IS NULL
                      AND c.queue = v_queue
                      -- The first bound is the index condition (rate-limited channels due later
                      -- are not even read); the second, evaluated again on the re-check, is exact.
                      AND c.next_turn_at <= v_wait_until
                      AND c.next_turn_at <= clock_timestamp()
                      AND (p_only IS NULL OR c.id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                    ORDER BY c.next_turn_at, c.id
                    LIMIT 1
                    FOR UPDATE;
            END IF;
            LOOP
                FETCH v_cur INTO r;
                EXIT WHEN NOT FOUND;
                v_n := v_n + 1;
                v_ids[v_n] := r.id;
                v_names[v_n] := r.name;
                v_turn[v_n] := r.weight * v_quantum;
                -- a turn left over from a larger quantum is simply finished
                v_used[v_n] := LEAST(r.turn_used, v_turn[v_n] - 1);
                -- the most this call may take: ready rows, free slots, one release if rate
                -- limited; and all but the rows, should more be counted (step 3b)
                v_cap[v_n] := fairqueue_claim_cap_v1(r.max_concurrency, r.running_count,
                                                     r.release_interval, r.mean_run,
                                                     p_by_time AND p_slow_start IS NOT FALSE,
                                                     p_limit);
                v_count[v_n] := r.ready_count;
                v_room[v_n] := LEAST(r.ready_count, v_cap[v_n]);
                v_short := v_short OR r.ready_count <= v_cap[v_n];
                v_interval[v_n] := r.release_interval;
                IF p_by_time THEN  -- (not computed by count: a function call per channel)
                    v_tag[v_n] := r.vtime;
                    v_last[v_n] := v_n;  -- (by time, served channels go back in walk order)
                    v_seq := v_n;
                    IF v_n = 1 THEN
                        v_first_tag := r.vtime;
                        IF NOT v_waited THEN
                            v_front := r.front;
                        END IF;
                    END IF;
                    v_est[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()), 1e-6)
                                  / r.weight;
                END IF;
                v_covered := v_covered + LEAST(
                    fairqueue_turn_left_v1(v_turn[v_n], v_used[v_n], p_by_time), v_room[v_n]);
                EXIT WHEN v_covered >= p_limit;
            END LOOP;
            CLOSE v_cur;
            IF v_waited THEN
                -- Step 2c. Still nothing. A channel a concurrent claim has just folded is
                -- not eligible in our snapshots yet (its new messages were still deltas
                -- there), and that claim holds the channel row until it commits, even when it
                -- does not serve the channel: wait for it the same way (bounded by the same
                -- lock_timeout), if a waking delta is still to be seen. Then, as any wait may
                -- have let such a claim commit, walk once more with a new snapshot, which sees
                -- its fold.
                IF v_n = 0 AND NOT v_fold_waited THEN
                    SELECT d.channel_id INTO v_folding
                    FROM fairqueue_channel_delta d
                    WHERE d.wake
                      AND (p_only IS NULL OR d.channel_id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (d.channel_id = ANY (p_exclude)))
                    ORDER BY d.id
                    LIMIT 1;
                    IF FOUND THEN
                        PERFORM FROM fairqueue_channel c WHERE c.id = v_folding FOR UPDATE;
                    END IF;
                    PERFORM set_config('lock_timeout', v_lock_timeout, true);
                    v_fold_waited := true;
                    v_waited := false;
                    v_now := clock_timestamp();
                    CONTINUE;
                END IF;
                PERFORM set_config('lock_timeout', v_lock_timeout, true);
                v_now := clock_timestamp();  -- for the charge, claimed_at and the lease
                -- The channel waited for was no longer claimable: the wait came back with no
                -- channel, or with one this walk holds already (its cursor went on past the
                -- one it waited for). The walk's channels are served as locked after all (not
                -- the second entry of the same channel), and nothing gave way: the top-up
                -- below may run.
                IF v_skipped > 0 AND (v_n = v_skipped
                                      OR array_position(v_ids, v_ids[v_n]) < v_n) THEN
                    v_room := v_kept_room || array_fill(0, ARRAY[v_n - v_skipped]);
                    v_skipped := 0;
                END IF;
                EXIT;
            END IF;
            -- By time, a channel held by a concurrent claim may be far ahead in tag order of the
            -- first one this walk locked (a tenant of short tasks, claimed by several claimers at
            -- once): skipping it would hand the claim to a channel of long tasks every time, and
            -- the shares would follow the lock traffic, not the tags. So when the smallest
            -- claimable tag (read without a lock) is below ours by more than one of its messages'
            -- charge, wait for that channel as in step 2b, and serve only it: the channels this
            -- walk locked are kept (locked to the commit) but given nothing.
            IF p_by_time AND v_n > 0 AND coalesce(p_wait_ms, 0) > 0 AND NOT v_fold_waited THEN
                IF v_front < v_first_tag THEN
                    v_skipped := v_n;
                    v_kept_room := v_room;
                    v_room := array_fill(0, ARRAY[v_n]);
                    v_covered := 0;
                END IF;
            END IF;
            EXIT WHEN (v_n > v_skipped) OR coalesce(p_wait_ms, 0) <= 0 OR v_fold_waited;
            v_waited := true;
            v_wait_until := clock_timestamp() + p_wait_ms * interval '1 millisecond';
            v_lock_timeout := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
        END LOOP;

        IF v_n = 0 THEN
            EXIT claim;
        END IF;

        -- Step 3b. A channel whose room is all the ready messages it counts may have more:
        -- enqueues that found it counting some wrote quiet deltas (fairqueue_delta_wakes_v1),
        -- which only the maintenance loop folds. Count them now (fairqueue_count_quiet_v1),
        -- so the shares below are made from what waits. None of this in a backlog that counts
        -- more than a claim takes, the steady traffic of many messages. (Not for a channel the
        -- walk keeps but gives nothing, by time: its room is 0.)
        IF v_short THEN
            SELECT q.o_free, q.o_ids, q.o_added INTO v_free, v_qids, v_qadded
            FROM fairqueue_count_quiet_v1(ARRAY(
                SELECT a.id FROM unnest(v_ids, v_count, v_cap) AS a(id, counted, cap)
                WHERE a.counted <= a.cap), v_own) q;
            FOR i IN 1 .. coalesce(cardinality(v_qids), 0) LOOP
                v_k := array_position(v_ids, v_qids[i]);
                IF v_room[v_k] > 0 THEN
                    v_room[v_k] := LEAST(v_count[v_k] + v_qadded[i], v_cap[v_k]);
                END IF;
            END LOOP;
        END IF;

        -- Step 3, by time: each message goes to the channel whose next message would start at the
        -- smallest tag (its tag plus what this claim gave it already, at its charge per message),
        -- up to its room: a merge of the channels' sequences of start tags, one statement on the
        -- arrays. A channel far ahead in tag order gets nothing though the walk locked it (with
        -- turns it would get its turn, and a tenant of long tasks took a slot in every claim of
        -- several messages). Channels go to the back in walk order.
        -- Each sequence stops at `bound`, after which no message the claim takes starts: the
        -- last start tag of the first `share` messages of every channel, where `share` is the
        -- fewest messages each channel must offer (each at most its room) for them to offer
        -- p_limit, found on the rooms in ascending order (`s`: what the smaller rooms hold, and
        -- how many channels share the rest). Those messages number p_limit or more and start
        -- at `bound` at the latest, so the merge's first p_limit do too. Unbounded, a claim of
        -- 100 sorted every channel's 100 start tags (2,500 for 25 channels, about 0.5 ms); now
        -- about what each gets and a few more. No `share` when the rooms hold less than
        -- p_limit: the sequences are whole, and the claim takes them all. (+ 2, not + 1: a
        -- start tag at `bound` itself is kept however the division rounds. That holds while a
        -- channel's charge per message is a few rounding steps of the tags or more, about 1e-15
        -- of them; below, `tag + i * est` rounds to the same few values for many i, and the
        -- sequence is kept whole.)
        IF p_by_time AND v_n = 1 THEN
            v_alloc := ARRAY[LEAST(v_room[1], p_limit)];  -- (a claim of one, mostly)
        ELSIF p_by_time THEN
            WITH a AS (
                SELECT a.k, a.tag, a.est, LEAST(a.room, p_limit) AS room
                FROM unnest(v_tag, v_est, v_room) WITH ORDINALITY AS a(tag, est, room, k)
            ), share AS (
                SELECT (p_limit - s.below + s.rest - 1) / s.rest AS n
                FROM (
                    SELECT a.room, lag(a.room, 1, 0) OVER w AS smaller,
                           sum(a.room) OVER w - a.room AS below,
                           count(*) OVER (ORDER BY a.room, a.k
                                          ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS rest
                    FROM a
                    WINDOW w AS (ORDER BY a.room, a.k ROWS UNBOUNDED PRECEDING)
                ) s
                WHERE (p_limit - s.below + s.rest - 1) / s.rest > s.smaller
                  AND (p_limit - s.below + s.rest - 1) / s.rest <= s.room
            ), bound AS (
                SELECT max(a.tag + (LEAST(a.room, share.n) - 1) * a.est) AS tag
                FROM a, share
                WHERE a.room > 0
            )
            SELECT array_agg(coalesce(g.n, 0)::integer ORDER BY o.k)
            INTO v_alloc
            FROM generate_series(1, v_n) AS o(k)
            LEFT JOIN (
                SELECT x.k, count(*) AS n
                FROM (
                    SELECT a.k
                    FROM a CROSS JOIN bound
                    CROSS JOIN LATERAL generate_series(0, CASE
                        WHEN a.est > (abs(bound.tag) + abs(a.tag)) * 1e-15 THEN greatest(0, LEAST(
                            a.room, floor((bound.tag - a.tag) / a.est) + 2))::integer
                        ELSE a.room END - 1) AS s(i)
                    ORDER BY a.tag + s.i * a.est, a.k
                    LIMIT p_limit
                ) x
                GROUP BY x.k
            ) g ON g.k = o.k;
        END IF;

        -- Step 3. Weighted water-filling in turn order. Round 0 gives each channel what is left of
        -- its current turn; later rounds (only when the channels found could not cover p_limit)
        -- give a whole turn each. Earlier channels get the remainder of a partial round, exactly
        -- as a sequence of smaller claims would.
        IF NOT p_by_time THEN
            v_alloc := array_fill(0, ARRAY[v_n]);
            v_last := array_fill(0, ARRAY[v_n]);
            v_left := p_limit;
            LOOP
                v_progress := false;
                FOR i IN 1 .. v_n LOOP
                    EXIT WHEN v_left = 0;
                    v_give := LEAST(
                        CASE WHEN v_round = 0 THEN v_turn[i] - v_used[i] ELSE v_turn[i] END,
                        v_room[i] - v_alloc[i],
                        v_left);
                    IF v_give > 0 THEN
                        v_alloc[i] := v_alloc[i] + v_give;
                        v_left := v_left - v_give;
                        v_progress := true;
                        v_seq := v_seq + 1;
                        v_last[i] := v_seq;
                    END IF;
                END LOOP;
                EXIT WHEN v_left = 0 OR NOT v_progress;
                v_round := v_round + 1;
            END LOOP;
        END IF;
    END IF;

    -- Step 3b, with groups (see step 3b below): the plan shared the claim out already, so
    -- what the ungrouped channels it drains count besides goes to them as what the claim has
    -- left, in walk order, up to their other limits (a group's channels are never such: their
    -- enqueues wake).
    IF v_grouped AND v_short THEN
        SELECT q.o_free, q.o_ids, q.o_added INTO v_free, v_qids, v_qadded
        FROM fairqueue_count_quiet_v1(ARRAY(
            SELECT a.id FROM unnest(v_ids, v_alloc, v_count) AS a(id, n, counted)
            WHERE a.n >= a.counted), v_own) q;
        IF v_qids IS NOT NULL THEN
            v_left := p_limit;
            FOR i IN 1 .. cardinality(v_ids) LOOP
                v_left := v_left - v_alloc[i];
            END LOOP;
            FOR i IN 1 .. cardinality(v_ids) LOOP
                EXIT WHEN v_left <= 0;
                v_k := array_position(v_qids, v_ids[i]);
                CONTINUE WHEN v_k IS NULL;
                v_give := LEAST(v_left, LEAST(v_count[i] + v_qadded[v_k], v_cap[i]) - v_alloc[i]);
                IF v_give > 0 THEN
                    v_alloc[i] := v_alloc[i] + v_give;
                    v_left := v_left - v_give;
                    v_seq := v_seq + 1;
                    v_last[i] := v_seq;
                END IF;
            END LOOP;
        END IF;
    END IF;

    -- Steps 4 and 5 in one statement. The LATERAL subquery reads each channel's head from
    -- fq_message_ready_idx and stops after its share. Ready messages of a channel are only
    -- ever claimed by the holder of that channel's row lock, which we took in step 2, and this
    -- statement's snapshot was taken after we got it, so it sees every earlier claim of the
    -- channel as committed. The rows are still locked, SKIP LOCKED: a ready row can be locked
    -- by someone else than a claim (cancel, delete, purge, an ORM update of the caller's),
    -- and a claim that waited for it while holding channel rows would deadlock with that
    -- transaction as soon as it wrote one of those channels. Skipping costs a lock record per
    -- claimed row; waiting could cost the whole fleet. A row locked here is ready (the lock
    -- re-checks the condition on the newest version) and stays so until we commit.
    -- Channels are charged with what was actually claimed (`got`), which may be less than
    -- their share, and so are the groups of grouped channels (none without groups: v_cg is
    -- NULL, and `ggot` empty with it).
    -- One lease token for the messages of this claim: it fences a claim from every other
    -- (docs/explanation/message-states.md), and a token per message cost a tenth of a claim of
    -- 100's server CPU where PostgreSQL is built without OpenSSL (each gen_random_uuid() then
    -- opens, reads and closes /dev/urandom).
    v_token := coalesce(p_token, gen_random_uuid());
    RETURN QUERY
    WITH alloc AS (
        SELECT a.cid, a.n FROM unnest(v_ids, v_alloc) AS a(cid, n)
    ), cand AS (
        SELECT h.ctid
        FROM alloc
        CROSS JOIN LATERAL (
            SELECT m.ctid
            FROM fairqueue_message m
            WHERE m.channel_id = alloc.cid AND m.state = 'ready'
            ORDER BY m.priority DESC, m.id
            LIMIT alloc.n
            FOR UPDATE OF m SKIP LOCKED
        ) h
        WHERE alloc.n > 0
    ), claimed AS (
        UPDATE fairqueue_message m
        SET state = 'running',
            attempts = m.attempts + 1,
            lease_token = v_token,
            lease_expires_at = v_now + p_lease,
            claimed_at = v_now,
            worker_id = p_worker
        -- = ANY(ARRAY(...)) of the locked rows' tuple ids makes this a TID scan: the rows are
        -- read where `cand` locked them, without a primary-key descent each (about a tenth
        -- of a claim of 100). A row we hold locked cannot move, and one that moved before we
        -- locked it is returned at its new place; a stale id would find no row visible to this
        -- statement, never another row. Nothing else in this condition: with `state = 'ready'`
        -- a generic plan made while the table was small read every ready row by the state
        -- index. A join to `cand` lets the planner guess thousands of rows for `LIMIT alloc.n`
        -- and hash a sequential scan of the whole message table (seen: 12 ms at 20k rows).
        WHERE m.ctid = ANY (ARRAY(SELECT cand.ctid FROM cand))
        RETURNING m.id, m.channel_id, m.task_name, m.payload, m.priority, m.attempts,
                  m.max_attempts, m.keep_result, m.lease_token, m.lease_expires_at,
                  m.enqueued_at, m.run_at,
                  -- an at-most-once message keeps this transaction's commit durable
                  CASE WHEN m.task_name = ANY (p_async_except) THEN fairqueue_hold_commit_v1() END
    ), got AS MATERIALIZED (
        -- MATERIALIZED: inlined, this aggregate is recomputed once per channel row of the
        -- update below (the planner expects one row); materialized it is computed once.
        -- `k` is the channel's position in the v_* arrays, for its weight, turn and interval
        -- (an array lookup instead of a join the planner would make a nested loop).
        SELECT claimed.channel_id AS cid, count(*)::integer AS n,
               array_position(v_ids, claimed.channel_id) AS k
        FROM claimed
        GROUP BY claimed.channel_id
    ), charged AS (
        UPDATE fairqueue_channel c
        SET running_count = c.running_count + got.n,
            ready_count = c.ready_count - got.n,
            last_claimed_at = v_now,
            -- Rate limited: next release no sooner than one interval from now.
            -- Otherwise the channel goes to the back of the round once its turn
            -- (weight * quantum messages) is used up; a partly used turn keeps its place.
            -- Served channels go to the back in the order this claim served them (one
            -- microsecond apart), so the next claim resumes the round where this one
            -- stopped; with all of them at v_now, ties went by id and the lowest ids took
            -- the remainder of every partial round (seen: 240 vs 160 per channel).
            next_turn_at = CASE
                WHEN v_interval[got.k] > interval '0' THEN v_now + v_interval[got.k]
                WHEN v_used[got.k] + got.n >= v_turn[got.k]
                    THEN v_now - (v_seq - v_last[got.k]) * interval '1 microsecond'
                ELSE c.next_turn_at
            END,
            turn_used = CASE
                WHEN v_interval[got.k] > interval '0' THEN 0
                ELSE (v_used[got.k] + got.n) % v_turn[got.k]
            END,
            -- By time: charged in advance, the channel's mean run time per message (divided by
            -- its weight), so a channel of long tasks cannot take many before any settles; the
            -- settlements' deltas correct the estimate when folded.
            vtime = CASE WHEN p_by_time THEN c.vtime + got.n * v_est[got.k] ELSE c.vtime END
        FROM got
        WHERE c.id = got.cid AND c.id = ANY (v_ids)  -- primary-key lookups, as above
        RETURNING c.id, c.ready_count, c.group_id
    ), drained AS (
        -- A channel whose counted ready messages this claim took all of, unless step 3b holds
        -- its name: quiet deltas of enqueues still in flight (fairqueue_delta_wakes_v1) may be
        -- all that will count what waits there. This marker, committed with the charge, has a
        -- claim's fold add them once they commit (fairqueue_fold_deltas_v1, drained mode).
        INSERT INTO fairqueue_channel_delta (channel_id, wake, drained)
        SELECT charged.id, false, true FROM charged
        WHERE charged.ready_count <= 0
          AND charged.group_id IS NULL  -- (a group's channels have no quiet deltas)
          AND NOT coalesce(charged.id = ANY (v_free), false)
        ON CONFLICT DO NOTHING  -- (one marker a channel: fq_delta_drained_uniq)
    ), ggot AS MATERIALIZED (
        -- what each group's channels got; by time its charge, each channel's mean run time
        -- per message (the group's weight divides it below)
        SELECT v_cg[got.k] AS gk, sum(got.n)::integer AS n,
               sum(got.n * v_mean[got.k]) AS charge
        FROM got
        WHERE v_cg[got.k] > 0
        GROUP BY v_cg[got.k]
    ), gcharged AS (
        -- the group's turn and rate limit, as a channel's above; its tag by time. (Its
        -- ready and running sums follow its channels': fairqueue_group_counters_v1.)
        UPDATE fairqueue_channel_group g
        SET last_claimed_at = v_now,
            next_turn_at = CASE
                WHEN v_ginterval[ggot.gk] > interval '0' THEN v_now + v_ginterval[ggot.gk]
                WHEN v_gused[ggot.gk] + ggot.n >= v_gturn[ggot.gk]
                    THEN v_now - (v_seq - v_glast[ggot.gk]) * interval '1 microsecond'
                ELSE g.next_turn_at
            END,
            turn_used = CASE
                WHEN v_ginterval[ggot.gk] > interval '0' THEN 0
                ELSE (v_gused[ggot.gk] + ggot.n) % v_gturn[ggot.gk]
            END,
            vtime = CASE WHEN p_by_time THEN g.vtime + ggot.charge / v_gweight[ggot.gk]
                         ELSE g.vtime END
        FROM ggot
        WHERE g.id = v_gids[ggot.gk] AND g.id = ANY (v_gids)
        RETURNING g.id
    )
    SELECT claimed.id, claimed.channel_id, v_names[array_position(v_ids, claimed.channel_id)],
           claimed.task_name::text,
           claimed.payload, claimed.priority, claimed.attempts::integer,
           claimed.max_attempts::integer, claimed.keep_result, claimed.lease_token,
           claimed.lease_expires_at, claimed.enqueued_at, claimed.run_at
    FROM claimed
    -- In the order a worker should start them (it may prefetch more than it runs at once).
    ORDER BY claimed.priority DESC, claimed.id;
    -- (`drained` and `gcharged` are not read: PostgreSQL runs every data-modifying CTE to
    -- completion, RETURNING lists included.)
    GET DIAGNOSTICS v_got = ROW_COUNT;
    END claim;

    -- The top-up (by time): slow start holds a new channel to one message at a time so that
    -- the claim serves the channels whose run time is known first, not so that a worker
    -- idles. A claim that came back short serves the slow-starting channels with the rest, in
    -- tag order, within their caps and rate limits (the same claim with slow start off: the
    -- channels it served already have no room left, or are slow-starting), under the same
    -- lease token; its rows follow the claim's, so a worker starts the known channels' first.
    -- Only when a slow-starting channel is left to serve, and no channel whose run time is
    -- known is: one that is claimable still, though the claim came back short, is held by a
    -- concurrent claim, and the slot is its own, not an idle worker's (one probe without a
    -- lock, as the front's, of the two walks' indexes: a short claim has read them already).
    -- Not when the walk kept the smallest tag for itself and gave the channels it locked
    -- nothing (see the wait above): those gave way to that tag. It waits (CLAIM_WAIT) for a
    -- channel a concurrent claim holds only when the claim holds no channel yet, as the claim
    -- does: claimers of one new channel queue for it rather than come back empty.
    IF p_by_time AND p_slow_start AND coalesce(v_got, 0) < p_limit
       AND coalesce(v_skipped, 0) = 0 THEN
        v_rest := CASE WHEN cardinality(v_queues) > 1 THEN v_queues ELSE ARRAY[v_queue] END;
        v_now := coalesce(v_now, clock_timestamp());  -- (an empty plan with groups has none)
        SELECT bool_or(k.slow AND k.found), bool_or(NOT k.slow AND k.found)
        INTO v_slow_left, v_known_left
        FROM unnest(ARRAY[true, false]) AS k0(slow)
        CROSS JOIN LATERAL (
            SELECT k0.slow,
                   EXISTS (
                       SELECT FROM fairqueue_channel c
                       WHERE c.claimable
                         AND c.group_id IS NULL
                         AND c.queue = ANY (v_rest)
                         AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
                         AND (c.mean_run IS NULL) = k0.slow
                         AND (p_only IS NULL OR c.id = ANY (p_only))
                         AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude))))
                   OR EXISTS (
                       SELECT FROM fairqueue_channel_group g
                       WHERE g.claimable > 0
                         AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                         AND g.queue = ANY (v_rest)
                         AND g.next_turn_at <= v_now
                         AND EXISTS (
                             SELECT FROM fairqueue_channel c
                             WHERE c.group_id IS NOT NULL
                               AND c.claimable
                               AND c.group_id = g.id
                               AND (c.release_interval = interval '0'
                                    OR c.next_turn_at <= v_now)
                               AND (c.mean_run IS NULL) = k0.slow
                               AND (p_only IS NULL OR c.id = ANY (p_only))
                               AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))))
                   AS found
        ) k;
        IF v_slow_left AND NOT v_known_left THEN
            RETURN QUERY SELECT * FROM fairqueue_claim_v1(
                p_limit - coalesce(v_got, 0), p_lease, p_worker, p_only, p_exclude, v_quantum,
                false, CASE WHEN v_ids IS NULL THEN p_wait_ms ELSE 0 END, true, v_rest,
                p_async_except, false, v_token);
        END IF;
    END IF;
END;
$$;
