-- django-fairqueue server functions: the plan of a claim when channel groups are claimable
-- (which flows it serves and what each gets); fairqueue_claim_v1 (claim.sql) takes and charges
-- what it returns.

-- Steps 2 and 3 of the fair claim when a channel group is claimable: which channels the
-- claim serves, and how many messages each gets (fairqueue_claim_v1 calls this with its
-- arguments, its clock reading and its quantum, then takes and charges what it returns, in
-- the statement the claim without groups runs). Two levels:
--
--   1. walk the top-level flows in turn order (by time: tag order), ungrouped channels
--      (fq_channel_turn_idx) and groups (fq_group_turn_idx) merged into one ordered stream;
--      each is locked when reached, FOR UPDATE SKIP LOCKED with its predicate re-checked on
--      the newest row version. A group reached is then walked like the channels of a small
--      queue: its claimable channels in turn (tag) order from fq_channel_in_group_turn_idx
--      (fq_channel_in_group_vtime_idx), locked SKIP LOCKED one per FETCH, until they cover
--      the group's turn. The walk stops once the flows found cover p_limit, so a claim
--      touches the groups and channels it serves (plus those passed over: locked by others,
--      or a group whose claimable channels are all rate limited, which is then parked until
--      the first of them is due);
--   2. share p_limit: by count, weighted water-filling at both levels (a group's turn is
--      its weight x quantum, shared among its channels by their own turns); by time, each
--      message to the flow of smallest start tag, within a group to its channel of smallest
--      start tag;
--   3. return the plan: the channels locked, in walk order, with their shares and what the
--      charge needs (turns, rate limits, estimates), each channel's group, and the groups
--      locked with theirs. fairqueue_claim_v1 charges the groups too: turn, rate limit and
--      tag; their counters move with their channels' (fairqueue_group_counters_v1).
--
-- A group's cap and rate limit are checked on its locked row, as a channel's are on its own:
-- every claim that serves a channel of the group holds the group row from its walk to its
-- commit, so two claims never both fill the group's last slot.
-- Locks: a group row, then its channels SKIP LOCKED (never waiting for a channel while
-- holding a group); an ungrouped channel is a channel row. The one wait (p_wait_ms,
-- CLAIM_WAIT) is for the first top-level flow in turn order when every flow was held by
-- others and the walk locked nothing, bounded by lock_timeout.
-- By time, this claim does not wait for a smallest tag held by a concurrent claim (it takes
-- the next flow, as fairqueue_claim_v1 does by count).
CREATE OR REPLACE FUNCTION fairqueue_plan_grouped_v1(
    p_limit integer,
    p_only bigint[],
    p_exclude bigint[],
    p_quantum integer,
    p_wait_ms integer,
    p_by_time boolean,
    p_now timestamptz,
    p_queue text,
    p_slow_start boolean,  -- false: the claim's top-up (see fairqueue_claim_v1)
    -- the plan (the arrays are fairqueue_claim_v1's, which it names after them)
    OUT o_now timestamptz,  -- the clock reading to charge with (read again after a wait)
    OUT o_ids bigint[],
    OUT o_names text[],
    OUT o_alloc integer[],
    OUT o_used integer[],
    OUT o_turn integer[],
    OUT o_interval interval[],
    OUT o_last integer[],
    OUT o_seq integer,
    OUT o_est double precision[],
    OUT o_mean double precision[],
    OUT o_cg integer[],
    OUT o_gids bigint[],
    OUT o_gused integer[],
    OUT o_gturn integer[],
    OUT o_ginterval interval[],
    OUT o_glast integer[],
    OUT o_gweight integer[]
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
-- The walk's stream must come from the two indexes in their order, read lazily (a Merge
-- Append of two index scans): a generic plan otherwise sorted a bitmap scan of every
-- claimable group, reading them all on every claim. No statement here needs a sort but the
-- result's order (a handful of rows), which PostgreSQL still sorts.
SET enable_sort = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_now timestamptz := p_now;
    v_due timestamptz := p_now;  -- the walk's bound on turns (the wait's: its deadline)
    v_cur refcursor;
    v_gcur refcursor;
    t record;
    r record;
    gr record;
    -- channels, in walk order (a group's channels are consecutive)
    v_ids bigint[] := '{}';
    v_names text[] := '{}';
    v_turn integer[] := '{}';
    v_used integer[] := '{}';
    v_room integer[] := '{}';
    v_interval interval[] := '{}';
    v_mean double precision[] := '{}';  -- charge per message before weights (by time)
    v_est double precision[] := '{}';  -- the channel tag's charge per message (by time)
    v_tag double precision[] := '{}';
    v_cg integer[] := '{}';  -- the channel's group (index into the v_g* arrays), 0: none
    -- groups, in walk order
    v_gids bigint[] := '{}';
    v_gturn integer[] := '{}';
    v_gused integer[] := '{}';
    v_groom integer[] := '{}';
    v_ginterval interval[] := '{}';
    v_gweight integer[] := '{}';
    v_gtag double precision[] := '{}';
    v_gfirst integer[] := '{}';  -- a group's channels: a ring through v_next, from v_gfirst
    v_gtail integer[] := '{}';
    v_gcount integer[] := '{}';
    v_gcap integer[] := '{}';  -- what a group's channels found give in their first turns
    v_next integer[] := '{}';
    v_turns integer := 0;  -- the turns of the flows found, added up
    v_target integer;
    -- the top-level flows in walk order: a channel's index, or minus a group's
    v_top integer[] := '{}';
    v_n integer := 0;
    v_ng integer := 0;
    v_covered integer := 0;
    v_gcov integer;
    v_cover integer;  -- what a channel found covers of its group's budget
    v_budget integer;
    v_passed boolean := false;
    v_waiting boolean := false;
    v_lock_timeout text;
    v_park timestamptz;
    -- sharing out
    v_alloc integer[];
    v_last integer[];
    v_tleft integer[];
    v_galloc integer[];
    v_glast integer[];
    v_gtleft integer[];
    v_gptr integer[];
    v_gcharge double precision[];
    v_seq integer := 0;
    v_left integer;
    v_give integer;
    v_given integer;
    v_stall integer;
    v_progress boolean;
    v_best integer;
    v_best_tag double precision;
    v_pick integer;
    v_pick_tag double precision;
    v_x double precision;
    e integer;
    i integer;
    j integer;
    k integer;
BEGIN
    LOOP  -- the walk; then, with p_wait_ms, once more waiting for the first flow
        IF p_by_time THEN
            OPEN v_cur FOR
                SELECT x.kind, x.fid FROM (
                    (SELECT 0 AS kind, c.id AS fid, c.vtime AS k1
                     FROM fairqueue_channel c
                     WHERE c.claimable
                       AND c.group_id IS NULL
                       AND c.queue = p_queue
                       AND (c.release_interval = interval '0' OR c.next_turn_at <= v_due)
                       AND (c.mean_run IS NOT NULL OR c.running_count = 0  -- not slow-starting
                            OR NOT p_slow_start)
                       AND (p_only IS NULL OR c.id = ANY (p_only))
                       AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                     ORDER BY c.vtime, c.id)
                    UNION ALL
                    (SELECT 1, g.id, g.vtime
                     FROM fairqueue_channel_group g
                     WHERE g.claimable > 0
                       AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                       AND g.queue = p_queue
                       AND g.next_turn_at <= v_due
                     ORDER BY g.vtime, g.id)
                ) x
                ORDER BY x.k1, x.fid;
        ELSE
            OPEN v_cur FOR
                SELECT x.kind, x.fid FROM (
                    (SELECT 0 AS kind, c.id AS fid, c.next_turn_at AS k1
                     FROM fairqueue_channel c
                     WHERE c.claimable
                       AND c.group_id IS NULL
                       AND c.queue = p_queue
                       AND c.next_turn_at <= v_due
                       AND (p_only IS NULL OR c.id = ANY (p_only))
                       AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                     ORDER BY c.next_turn_at, c.id)
                    UNION ALL
                    (SELECT 1, g.id, g.next_turn_at
                     FROM fairqueue_channel_group g
                     WHERE g.claimable > 0
                       AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                       AND g.queue = p_queue
                       AND g.next_turn_at <= v_due
                     ORDER BY g.next_turn_at, g.id)
                ) x
                ORDER BY x.k1, x.fid;
        END IF;
        LOOP
            FETCH v_cur INTO t;
            EXIT WHEN NOT FOUND;
            IF t.kind = 0 THEN
                -- An ungrouped channel: lock it, re-checking its predicate on the newest row.
                IF v_waiting THEN
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                    INTO r FROM fairqueue_channel c
                    WHERE c.id = t.fid AND c.claimable
                      AND c.group_id IS NULL
                      AND (c.release_interval = interval '0'
                           OR c.next_turn_at <= clock_timestamp())
                      AND (NOT (p_by_time AND p_slow_start) OR c.mean_run IS NOT NULL
                           OR c.running_count = 0)
                    FOR UPDATE;
                ELSE
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                    INTO r FROM fairqueue_channel c
                    WHERE c.id = t.fid AND c.claimable
                      AND c.group_id IS NULL
                      AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
                      AND (NOT (p_by_time AND p_slow_start) OR c.mean_run IS NOT NULL
                           OR c.running_count = 0)
                    FOR UPDATE SKIP LOCKED;
                END IF;
                IF NOT FOUND THEN
                    v_passed := true;
                    EXIT WHEN v_waiting;
                    CONTINUE;
                END IF;
                v_n := v_n + 1;
                v_ids[v_n] := r.id;
                v_names[v_n] := r.name;
                v_turn[v_n] := r.weight * p_quantum;
                v_used[v_n] := LEAST(r.turn_used, v_turn[v_n] - 1);
                v_room[v_n] := LEAST(r.ready_count, fairqueue_claim_cap_v1(
                    r.max_concurrency, r.running_count, r.release_interval, r.mean_run,
                    p_by_time AND p_slow_start, p_limit));
                v_interval[v_n] := r.release_interval;
                v_mean[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()), 1e-6);
                v_est[v_n] := v_mean[v_n] / r.weight;
                v_tag[v_n] := r.vtime;
                v_cg[v_n] := 0;
                v_next[v_n] := 0;
                v_top := v_top || v_n;
                v_turns := v_turns + v_turn[v_n];
                v_covered := v_covered + LEAST(
                    fairqueue_turn_left_v1(v_turn[v_n], v_used[v_n], p_by_time), v_room[v_n]);
            ELSE
                -- A group: lock it, re-checking its predicate (cap, turn) on the newest row.
                IF v_waiting THEN
                    SELECT g.id, g.weight, g.turn_used, g.release_interval, g.max_concurrency,
                           g.running_count, g.vtime
                    INTO gr FROM fairqueue_channel_group g
                    WHERE g.id = t.fid AND g.claimable > 0
                      AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                      AND g.next_turn_at <= clock_timestamp()
                    FOR UPDATE;
                ELSE
                    SELECT g.id, g.weight, g.turn_used, g.release_interval, g.max_concurrency,
                           g.running_count, g.vtime
                    INTO gr FROM fairqueue_channel_group g
                    WHERE g.id = t.fid AND g.claimable > 0
                      AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                      AND g.next_turn_at <= v_now
                    FOR UPDATE SKIP LOCKED;
                END IF;
                IF NOT FOUND THEN
                    v_passed := true;
                    EXIT WHEN v_waiting;
                    CONTINUE;
                END IF;
                IF v_waiting THEN
                    v_now := clock_timestamp();
                END IF;
                v_ng := v_ng + 1;
                v_gids[v_ng] := gr.id;
                v_gturn[v_ng] := gr.weight * p_quantum;
                v_gused[v_ng] := LEAST(gr.turn_used, v_gturn[v_ng] - 1);
                v_groom[v_ng] := LEAST(
                    coalesce(gr.max_concurrency - gr.running_count, p_limit),
                    CASE WHEN gr.release_interval > interval '0' THEN 1 ELSE p_limit END,
                    p_limit);
                v_ginterval[v_ng] := gr.release_interval;
                v_gweight[v_ng] := gr.weight;
                v_gtag[v_ng] := gr.vtime;
                v_gfirst[v_ng] := 0;
                v_gtail[v_ng] := 0;
                v_gcount[v_ng] := 0;
                v_gcap[v_ng] := 0;
                v_budget := LEAST(fairqueue_turn_left_v1(v_gturn[v_ng], v_gused[v_ng], p_by_time),
                                  v_groom[v_ng],
                                  p_limit - v_covered);
                v_gcov := 0;
                -- Its channels, in turn (tag) order; the WHERE repeats the predicate of
                -- fq_channel_in_group_turn_idx (fq_channel_in_group_vtime_idx) word for word.
                IF p_by_time THEN
                    OPEN v_gcur FOR
                        SELECT c.id, c.name::text AS name, c.weight, c.turn_used,
                               c.release_interval, c.ready_count, c.max_concurrency,
                               c.running_count, c.mean_run, c.vtime
                        FROM fairqueue_channel c
                        WHERE c.group_id IS NOT NULL
                          AND c.claimable
                          AND c.group_id = gr.id
                          AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
                          AND (c.mean_run IS NOT NULL OR c.running_count = 0  -- not slow-starting
                               OR NOT p_slow_start)
                          AND (p_only IS NULL OR c.id = ANY (p_only))
                          AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                        ORDER BY c.vtime, c.id
                        FOR UPDATE SKIP LOCKED;
                ELSE
                    OPEN v_gcur FOR
                        SELECT c.id, c.name::text AS name, c.weight, c.turn_used,
                               c.release_interval, c.ready_count, c.max_concurrency,
                               c.running_count, c.mean_run, c.vtime
                        FROM fairqueue_channel c
                        WHERE c.group_id IS NOT NULL
                          AND c.claimable
                          AND c.group_id = gr.id
                          AND c.next_turn_at <= v_now
                          AND (p_only IS NULL OR c.id = ANY (p_only))
                          AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                        ORDER BY c.next_turn_at, c.id
                        FOR UPDATE SKIP LOCKED;
                END IF;
                LOOP
                    FETCH v_gcur INTO r;
                    EXIT WHEN NOT FOUND;
                    v_n := v_n + 1;
                    v_ids[v_n] := r.id;
                    v_names[v_n] := r.name;
                    v_turn[v_n] := r.weight * p_quantum;
                    v_used[v_n] := LEAST(r.turn_used, v_turn[v_n] - 1);
                    v_room[v_n] := LEAST(r.ready_count, fairqueue_claim_cap_v1(
                        r.max_concurrency, r.running_count, r.release_interval, r.mean_run,
                        p_by_time AND p_slow_start, p_limit));
                    v_interval[v_n] := r.release_interval;
                    v_mean[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()),
                                            1e-6);
                    v_est[v_n] := v_mean[v_n] / r.weight;
                    v_tag[v_n] := r.vtime;
                    v_cg[v_n] := v_ng;
                    IF v_gcount[v_ng] = 0 THEN
                        v_gfirst[v_ng] := v_n;
                    ELSE
                        v_next[v_gtail[v_ng]] := v_n;
                    END IF;
                    v_next[v_n] := v_gfirst[v_ng];
                    v_gtail[v_ng] := v_n;
                    v_gcount[v_ng] := v_gcount[v_ng] + 1;
                    v_cover := LEAST(fairqueue_turn_left_v1(v_turn[v_n], v_used[v_n], p_by_time),
                                     v_room[v_n]);
                    v_gcap[v_ng] := v_gcap[v_ng] + v_cover;
                    v_gcov := v_gcov + v_cover;
                    EXIT WHEN v_gcov >= v_budget;
                END LOOP;
                CLOSE v_gcur;
                IF v_gcount[v_ng] = 0 THEN
                    -- No channel of the group could be taken. When that is because its
                    -- claimable channels are rate limited and none is due yet, park the group
                    -- until the first is (its turn moves there; a channel becoming claimable
                    -- wakes it sooner). Channels held by concurrent claims park nothing.
                    SELECT c.next_turn_at INTO v_park
                    FROM fairqueue_channel c
                    WHERE c.group_id IS NOT NULL
                      AND c.claimable
                      AND c.group_id = gr.id
                    ORDER BY c.next_turn_at, c.id
                    LIMIT 1;
                    IF v_park > v_now THEN
                        UPDATE fairqueue_channel_group g
                        SET next_turn_at = greatest(g.next_turn_at, v_park)
                        WHERE g.id = gr.id;
                    ELSE
                        v_passed := true;
                    END IF;
                    v_ng := v_ng - 1;
                    EXIT WHEN v_waiting;
                    CONTINUE;
                END IF;
                v_top := v_top || (-v_ng);
                v_covered := v_covered + LEAST(v_budget, v_gcov);
                v_turns := v_turns + v_gturn[v_ng];
            END IF;
            EXIT WHEN v_covered >= p_limit OR v_waiting;
        END LOOP;
        CLOSE v_cur;
        IF v_waiting THEN
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            v_now := clock_timestamp();  -- for the charge, claimed_at and the lease
            EXIT;
        END IF;
        -- Nothing unlocked was claimable, and concurrent claims hold what is: queue behind
        -- the first flow in turn order, as fairqueue_claim_v1's step 2b does (bounded by
        -- lock_timeout = p_wait_ms, only in a claim that is its own transaction).
        EXIT WHEN v_n > 0 OR NOT v_passed OR coalesce(p_wait_ms, 0) <= 0;
        v_waiting := true;
        v_due := clock_timestamp() + p_wait_ms * interval '1 millisecond';
        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
    END LOOP;

    -- The walk ran out of flows before their first turns covered p_limit, so later turns
    -- will be shared out too, and a group's walk stopped at its first turn: take more
    -- channels of each group, in their order, until their first turns cover the group's
    -- share of p_limit by turns (plus one turn), as the walk of ungrouped channels covers
    -- p_limit with first turns. Nobody else can serve a group's channels while this
    -- claim holds the group, so this costs no one a channel; the shares add up to p_limit,
    -- so it fetches at most about p_limit more channels in all.
    FOR k IN 1 .. CASE WHEN v_covered < p_limit THEN v_ng ELSE 0 END LOOP
        v_target := LEAST(v_groom[k], ceil(p_limit::numeric * v_gturn[k] / v_turns)::integer
                                      + v_gturn[k]);
        IF v_gcap[k] < v_target THEN
            IF p_by_time THEN
                OPEN v_gcur FOR
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used,
                           c.release_interval, c.ready_count, c.max_concurrency,
                           c.running_count, c.mean_run, c.vtime
                    FROM fairqueue_channel c
                    WHERE c.group_id IS NOT NULL
                      AND c.claimable
                      AND c.group_id = v_gids[k]
                      AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
                      AND (c.mean_run IS NOT NULL OR c.running_count = 0  -- not slow-starting
                           OR NOT p_slow_start)
                      AND NOT (c.id = ANY (v_ids))
                      AND (p_only IS NULL OR c.id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                    ORDER BY c.vtime, c.id
                    FOR UPDATE SKIP LOCKED;
            ELSE
                OPEN v_gcur FOR
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used,
                           c.release_interval, c.ready_count, c.max_concurrency,
                           c.running_count, c.mean_run, c.vtime
                    FROM fairqueue_channel c
                    WHERE c.group_id IS NOT NULL
                      AND c.claimable
                      AND c.group_id = v_gids[k]
                      AND c.next_turn_at <= v_now
                      AND NOT (c.id = ANY (v_ids))
                      AND (p_only IS NULL OR c.id = ANY (p_only))
                      AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                    ORDER BY c.next_turn_at, c.id
                    FOR UPDATE SKIP LOCKED;
            END IF;
            LOOP
                EXIT WHEN v_gcap[k] >= v_target;
                FETCH v_gcur INTO r;
                EXIT WHEN NOT FOUND;
                v_n := v_n + 1;
                v_ids[v_n] := r.id;
                v_names[v_n] := r.name;
                v_turn[v_n] := r.weight * p_quantum;
                v_used[v_n] := LEAST(r.turn_used, v_turn[v_n] - 1);
                v_room[v_n] := LEAST(r.ready_count, fairqueue_claim_cap_v1(
                    r.max_concurrency, r.running_count, r.release_interval, r.mean_run,
                    p_by_time AND p_slow_start, p_limit));
                v_interval[v_n] := r.release_interval;
                v_mean[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()), 1e-6);
                v_est[v_n] := v_mean[v_n] / r.weight;
                v_tag[v_n] := r.vtime;
                v_cg[v_n] := k;
                v_next[v_gtail[k]] := v_n;
                v_next[v_n] := v_gfirst[k];
                v_gtail[k] := v_n;
                v_gcount[k] := v_gcount[k] + 1;
                v_gcap[k] := v_gcap[k] + LEAST(
                    fairqueue_turn_left_v1(v_turn[v_n], v_used[v_n], p_by_time), v_room[v_n]);
            END LOOP;
            CLOSE v_gcur;
        END IF;
    END LOOP;

    IF v_n = 0 THEN
        RETURN;  -- nothing to take (o_ids NULL)
    END IF;

    v_alloc := array_fill(0, ARRAY[v_n]);
    v_last := array_fill(0, ARRAY[v_n]);
    v_galloc := array_fill(0, ARRAY[greatest(v_ng, 1)]);
    v_glast := array_fill(0, ARRAY[greatest(v_ng, 1)]);
    v_left := p_limit;
    IF p_by_time THEN
        -- Each message to the flow whose next message starts at the smallest tag (a group's:
        -- its tag plus what this claim charged it so far), within a group to its channel of
        -- smallest start tag; each up to its room.
        v_gcharge := array_fill(0::double precision, ARRAY[greatest(v_ng, 1)]);
        WHILE v_left > 0 LOOP
            v_best := 0;
            v_best_tag := NULL;
            FOREACH e IN ARRAY v_top LOOP
                IF e > 0 THEN
                    CONTINUE WHEN v_alloc[e] >= v_room[e];
                    v_x := v_tag[e] + v_alloc[e] * v_est[e];
                    IF v_best_tag IS NULL OR v_x < v_best_tag THEN
                        v_best := e;
                        v_best_tag := v_x;
                    END IF;
                ELSE
                    k := -e;
                    CONTINUE WHEN v_galloc[k] >= v_groom[k];
                    v_x := v_gtag[k] + v_gcharge[k];
                    CONTINUE WHEN v_best_tag IS NOT NULL AND v_x >= v_best_tag;
                    v_pick := 0;
                    v_pick_tag := NULL;
                    j := v_gfirst[k];
                    LOOP
                        IF v_alloc[j] < v_room[j]
                           AND (v_pick_tag IS NULL
                                OR v_tag[j] + v_alloc[j] * v_est[j] < v_pick_tag) THEN
                            v_pick := j;
                            v_pick_tag := v_tag[j] + v_alloc[j] * v_est[j];
                        END IF;
                        j := v_next[j];
                        EXIT WHEN j = v_gfirst[k];
                    END LOOP;
                    CONTINUE WHEN v_pick = 0;
                    v_best := v_pick;
                    v_best_tag := v_x;
                END IF;
            END LOOP;
            EXIT WHEN v_best = 0;
            v_alloc[v_best] := v_alloc[v_best] + 1;
            v_left := v_left - 1;
            k := v_cg[v_best];
            IF k > 0 THEN
                v_galloc[k] := v_galloc[k] + 1;
                v_gcharge[k] := v_gcharge[k] + v_mean[v_best] / v_gweight[k];
            END IF;
        END LOOP;
        -- (turns do not order anything by time; flows go to the back in walk order)
        v_last := ARRAY(SELECT generate_series(1, v_n));
        v_glast := ARRAY(SELECT coalesce(v_gtail[x], 0)
                         FROM generate_series(1, greatest(v_ng, 1)) AS x);
        v_seq := v_n;
    ELSE
        -- Weighted water-filling in turn order at both levels: a flow gets what is left of its
        -- turn first, then whole turns while the flows found cannot cover p_limit. A group's
        -- turn is shared among its channels in their order, each up to what is left of its
        -- own turn; a channel whose turn ends goes to the back of the group's round.
        v_tleft := ARRAY(SELECT v_turn[x] - v_used[x] FROM generate_series(1, v_n) AS x);
        v_gtleft := ARRAY(SELECT v_gturn[x] - v_gused[x]
                          FROM generate_series(1, greatest(v_ng, 1)) AS x);
        v_gptr := v_gfirst;
        LOOP
            v_progress := false;
            FOREACH e IN ARRAY v_top LOOP
                EXIT WHEN v_left = 0;
                IF e > 0 THEN
                    v_give := LEAST(v_tleft[e], v_room[e] - v_alloc[e], v_left);
                    IF v_give > 0 THEN
                        v_alloc[e] := v_alloc[e] + v_give;
                        v_left := v_left - v_give;
                        v_progress := true;
                        v_seq := v_seq + 1;
                        v_last[e] := v_seq;
                        v_tleft[e] := v_tleft[e] - v_give;
                        IF v_tleft[e] = 0 THEN
                            v_tleft[e] := v_turn[e];
                        END IF;
                    END IF;
                ELSE
                    k := -e;
                    v_budget := LEAST(v_gtleft[k], v_groom[k] - v_galloc[k], v_left);
                    v_given := 0;
                    v_stall := 0;
                    WHILE v_given < v_budget AND v_stall < v_gcount[k] LOOP
                        i := v_gptr[k];
                        v_give := LEAST(v_tleft[i], v_room[i] - v_alloc[i], v_budget - v_given);
                        IF v_give > 0 THEN
                            v_alloc[i] := v_alloc[i] + v_give;
                            v_given := v_given + v_give;
                            v_seq := v_seq + 1;
                            v_last[i] := v_seq;
                            v_tleft[i] := v_tleft[i] - v_give;
                            v_stall := 0;
                            IF v_tleft[i] = 0 THEN
                                v_tleft[i] := v_turn[i];
                                v_gptr[k] := v_next[i];
                            END IF;
                        ELSE
                            v_gptr[k] := v_next[i];
                            v_stall := v_stall + 1;
                        END IF;
                    END LOOP;
                    IF v_given > 0 THEN
                        v_galloc[k] := v_galloc[k] + v_given;
                        v_left := v_left - v_given;
                        v_progress := true;
                        v_seq := v_seq + 1;
                        v_glast[k] := v_seq;
                        v_gtleft[k] := v_gtleft[k] - v_given;
                        IF v_gtleft[k] = 0 THEN
                            v_gtleft[k] := v_gturn[k];
                        END IF;
                    END IF;
                END IF;
            END LOOP;
            EXIT WHEN v_left = 0 OR NOT v_progress;
        END LOOP;
    END IF;

    o_now := v_now;
    o_ids := v_ids;
    o_names := v_names;
    o_alloc := v_alloc;
    o_used := v_used;
    o_turn := v_turn;
    o_interval := v_interval;
    o_last := v_last;
    o_seq := v_seq;
    o_est := v_est;
    o_mean := v_mean;
    o_cg := v_cg;
    o_gids := v_gids;
    o_gused := v_gused;
    o_gturn := v_gturn;
    o_ginterval := v_ginterval;
    o_glast := v_glast;
    o_gweight := v_gweight;
END;
$$;
