-- django-fairqueue server functions: fold and counters. The fold of the counter deltas
-- every writer of messages records into their channel rows: in bulk by claims and the
-- maintenance, and for one channel at once after an operator's change.

-- Correct the tags of the groups of channels p_ids by what their messages really ran:
-- p_run[i] seconds for p_runs[i] messages of channel p_ids[i] (releases: no seconds, what the
-- claim charged given back). Each of those messages was charged to its group at its claim at
-- its channel's mean run time (the default while the channel had none) divided by the
-- group's weight (fairqueue_claim_v1); this adds what ran less that estimate, divided by the
-- group's weight, as the fold does to the channel's own tag. So a group whose work lands in
-- fresh channels (one per user or document), each charged the default estimate at its only
-- claim, is charged what its messages really took. The folds call this holding the channels
-- and their groups, before they move the channels' means (the estimates the claims charged).
-- Ungrouped channels change nothing.
CREATE OR REPLACE FUNCTION fairqueue_correct_groups_v1(
    p_ids bigint[], p_run double precision[], p_runs bigint[]
)
RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
BEGIN
    UPDATE fairqueue_channel_group g
    SET vtime = g.vtime + x.fix / g.weight
    FROM (
        SELECT c.group_id,
               sum(p_run[array_position(p_ids, c.id)]
                   - p_runs[array_position(p_ids, c.id)]
                     * coalesce(c.mean_run, fairqueue_default_run_v1())) AS fix
        FROM fairqueue_channel c
        WHERE c.id = ANY (p_ids) AND c.group_id IS NOT NULL
        GROUP BY c.group_id
    ) x
    WHERE g.id = x.group_id AND x.fix <> 0;
END;
$$;


-- Fold pending counter deltas into their channel rows. With p_wake_only, only deltas that may
-- make a channel claimable (new ready messages; freed slots of a capped channel) are folded:
-- the claim does this before picking channels. The others (completions on uncapped channels)
-- change no eligibility, so the maintenance loop folds them in bulk (p_wake_only = false), one
-- channel update per channel per pass instead of one per completed batch.
-- Only deltas whose channel row can be locked right now are folded (SKIP LOCKED on both): a
-- channel locked by a concurrent claim is folded by that claim, so nobody waits here.
-- Returns how many delta rows were folded.
-- enable_seqscan = off: on a small channel table the planner prefers a sequential scan to a
-- hundred primary-key lookups, which is cheaper there but makes the fold's cost grow with the
-- number of channels; we want it to grow with the number of deltas only, at any size.
-- Every fold adds the run time settlements recorded to the channel's mean (`mean_run`). With
-- p_by_time (fairness by time) it also corrects the tags, the channel's and its group's (the
-- claim charged the mean; the delta says what really ran), and lifts each channel it makes
-- claimable to the system's virtual time (fairqueue_virtual_time_v1, read once per call,
-- before the update).
CREATE OR REPLACE FUNCTION fairqueue_fold_deltas_v1(
    p_limit integer, p_wake_only boolean, p_by_time boolean DEFAULT false
)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
DECLARE
    v_deltas bigint[];
    v_delta_channels bigint[];
    v_wanted bigint[];
    v_locked bigint[];
    v_groups bigint[];
    v_glocked bigint[];
    v_ids bigint[];
    v_ready bigint[];
    v_scheduled bigint[];
    v_running bigint[];
    v_failed bigint[];
    v_succeeded bigint[];
    v_batches boolean[];
    v_run double precision[];
    v_runs bigint[];
    v_ran bigint[];
    v_vnow double precision;
    v_count integer;
BEGIN
    -- 1. Lock the oldest pending deltas. Two statements rather than `d.wake OR NOT
    --    p_wake_only`, so the first can use the partial index fq_delta_wake_idx. Every claim
    --    calls this and there is usually nothing to fold: a bare probe of the index answers
    --    that for less than the locking aggregate.
    IF p_wake_only THEN
        IF NOT EXISTS (SELECT FROM fairqueue_channel_delta d WHERE d.wake) THEN
            RETURN 0;
        END IF;
        SELECT array_agg(x.id), array_agg(x.channel_id), array_agg(DISTINCT x.channel_id)
        INTO v_deltas, v_delta_channels, v_wanted FROM (
            SELECT d.id, d.channel_id FROM fairqueue_channel_delta d
            WHERE d.wake ORDER BY d.id LIMIT p_limit FOR UPDATE SKIP LOCKED
        ) x;
    ELSE
        SELECT array_agg(x.id), array_agg(x.channel_id), array_agg(DISTINCT x.channel_id)
        INTO v_deltas, v_delta_channels, v_wanted FROM (
            SELECT d.id, d.channel_id FROM fairqueue_channel_delta d
            ORDER BY d.id LIMIT p_limit FOR UPDATE SKIP LOCKED
        ) x;
    END IF;
    IF v_deltas IS NULL THEN
        RETURN 0;
    END IF;

    -- 2. Lock their channels by primary key, skipping those a claim holds right now (that
    --    claim, or the next, folds them). A join of deltas to channels in one locking query
    --    was planned as a sequential scan of every channel.
    SELECT array_agg(x.id ORDER BY x.id),
           array_agg(DISTINCT x.group_id) FILTER (WHERE x.group_id IS NOT NULL)
    INTO v_locked, v_groups FROM (
        SELECT c.id, c.group_id FROM fairqueue_channel c
        WHERE c.id = ANY (v_wanted) ORDER BY c.id FOR UPDATE SKIP LOCKED
    ) x;
    IF coalesce(cardinality(v_locked), 0) < cardinality(v_wanted) THEN
        -- Deltas of a channel deleted meanwhile (a completion that committed after the
        -- deletion began) belong to nobody: delete them, or every claim would find them again.
        DELETE FROM fairqueue_channel_delta d
        WHERE d.id = ANY (ARRAY(
            SELECT x.id FROM unnest(v_deltas, v_delta_channels) AS x(id, channel_id)
            WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = x.channel_id)));
    END IF;
    IF v_locked IS NULL THEN
        RETURN 0;
    END IF;
    -- 2b. Their groups, SKIP LOCKED too: folding a grouped channel moves its group's sums
    --     (fairqueue_group_counters_v1), and a group held by a claim is the claim's to fold
    --     after. The channels of a group held elsewhere are left for the next fold.
    IF v_groups IS NOT NULL THEN
        v_glocked := ARRAY(
            SELECT g.id FROM fairqueue_channel_group g
            WHERE g.id = ANY (v_groups) ORDER BY g.id FOR UPDATE SKIP LOCKED);
        IF cardinality(v_glocked) < cardinality(v_groups) THEN
            v_locked := ARRAY(
                SELECT c.id FROM fairqueue_channel c
                WHERE c.id = ANY (v_locked)
                  AND (c.group_id IS NULL OR c.group_id = ANY (v_glocked))
                ORDER BY c.id);
            IF cardinality(v_locked) = 0 THEN
                RETURN 0;
            END IF;
        END IF;
    END IF;

    -- 3. Delete the deltas of the locked channels and sum them per channel. Which deltas
    --    those are is worked out from step 1's arrays, so the DELETE names rows by primary
    --    key only: with `AND d.channel_id = ANY (v_locked)` in it, a generic plan sometimes
    --    took fq_delta_channel_idx and read every pending delta of those channels (the
    --    maintenance loop's non-waking ones included: 5,010 rows to delete 10; in steady
    --    traffic 6.4 of a claim of 100's 10.8 ms). tests/test_explain.py checks.
    --    (Every channel locked, the usual case: they are step 1's deltas, no statement.)
    IF cardinality(v_locked) < cardinality(v_wanted) THEN
        v_deltas := ARRAY(
            SELECT x.id FROM unnest(v_deltas, v_delta_channels) AS x(id, channel_id)
            WHERE x.channel_id = ANY (v_locked)
        );
    END IF;
    WITH gone AS (
        DELETE FROM fairqueue_channel_delta d
        WHERE d.id = ANY (v_deltas)
        RETURNING d.channel_id, d.ready, d.scheduled, d.running, d.failed, d.succeeded,
                  d.batch_pending, d.run_seconds, d.run_count
    ), g AS (
        SELECT gone.channel_id, sum(gone.ready) AS ready, sum(gone.scheduled) AS scheduled,
               sum(gone.running) AS running, sum(gone.failed) AS failed,
               sum(gone.succeeded) AS succeeded, bool_or(gone.batch_pending) AS batches,
               sum(gone.run_seconds) AS run, sum(gone.run_count) AS runs,
               -- the mean learns from messages that ran, not from releases (nothing ran)
               coalesce(sum(gone.run_count) FILTER (WHERE gone.run_seconds > 0), 0) AS ran,
               count(*) AS n
        FROM gone
        GROUP BY gone.channel_id
    )
    SELECT array_agg(g.channel_id ORDER BY g.channel_id), array_agg(g.ready ORDER BY g.channel_id),
           array_agg(g.scheduled ORDER BY g.channel_id), array_agg(g.running ORDER BY g.channel_id),
           array_agg(g.failed ORDER BY g.channel_id), array_agg(g.succeeded ORDER BY g.channel_id),
           array_agg(g.batches ORDER BY g.channel_id), array_agg(g.run ORDER BY g.channel_id),
           array_agg(g.runs ORDER BY g.channel_id), array_agg(g.ran ORDER BY g.channel_id),
           sum(g.n)
    INTO v_ids, v_ready, v_scheduled, v_running, v_failed, v_succeeded, v_batches, v_run,
         v_runs, v_ran, v_count
    FROM g;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    IF p_by_time THEN
        v_vnow := fairqueue_virtual_time_v1();
        -- 3b. The groups of grouped channels among them (locked in step 2b), by what really
        --     ran, before step 4 moves the means their claims charged. A group that becomes
        --     claimable in step 4 is then lifted from its corrected tag (its trigger).
        IF v_groups IS NOT NULL THEN
            PERFORM fairqueue_correct_groups_v1(v_ids, v_run, v_runs);
        END IF;
    END IF;

    -- 4. Add the sums: primary-key lookups, each row's sums found by its array position.
    UPDATE fairqueue_channel c
    SET ready_count = c.ready_count + v_ready[array_position(v_ids, c.id)],
        scheduled_count = c.scheduled_count + v_scheduled[array_position(v_ids, c.id)],
        running_count = c.running_count + v_running[array_position(v_ids, c.id)],
        failed_count = c.failed_count + v_failed[array_position(v_ids, c.id)],
        succeeded_total = c.succeeded_total + v_succeeded[array_position(v_ids, c.id)],
        -- set by whatever made a work batch pending (plan, retry, failure, release, rescue);
        -- cleared only by a batch claim holding the row that finds none pending
        batch_pending = c.batch_pending OR v_batches[array_position(v_ids, c.id)],
        -- A channel without a rate limit is never due later than now. Its turn can only be in
        -- the future when the database clock stepped back (the turn was set by the old clock)
        -- or an operator removed its rate limit: either would park it until the clock caught
        -- up. Folding is what makes a channel claimable, so this is where it is put right
        -- (at the front of the round: a one-off, not a way to jump the queue). The start of
        -- the statement, not the clock now: the claim calling this compares turns with the
        -- clock it read before.
        next_turn_at = CASE
            WHEN c.release_interval = interval '0' AND c.next_turn_at > statement_timestamp()
                THEN statement_timestamp()
            ELSE c.next_turn_at
        END,
        -- The tag: the claim charged the mean run time per message; add what really ran
        -- minus that (divided by the weight). A channel this fold makes claimable (it was
        -- not: no ready message, or at its cap) is lifted to the system's virtual time.
        vtime = CASE WHEN NOT p_by_time THEN c.vtime ELSE fairqueue_lift_v1(
            c.vtime + (v_run[array_position(v_ids, c.id)]
                       - v_runs[array_position(v_ids, c.id)]
                         * coalesce(c.mean_run, fairqueue_default_run_v1())) / c.weight,
            -- a grouped channel is lifted within its group
            CASE WHEN c.group_id IS NULL THEN v_vnow
                 ELSE fairqueue_group_virtual_time_v1(c.group_id, c.id) END,
            c.claimable,
            c.ready_count + v_ready[array_position(v_ids, c.id)] > 0 AND NOT c.paused
                AND (c.max_concurrency IS NULL
                     OR c.running_count + v_running[array_position(v_ids, c.id)]
                        < c.max_concurrency),
            -- at most one message's charge ahead (its mean as this fold leaves it)
            fairqueue_charge_v1(fairqueue_mean_run_v1(
                c.mean_run, v_run[array_position(v_ids, c.id)],
                v_ran[array_position(v_ids, c.id)]), c.weight))
        END,
        mean_run = fairqueue_mean_run_v1(
            c.mean_run, v_run[array_position(v_ids, c.id)], v_ran[array_position(v_ids, c.id)])
    WHERE c.id = ANY (v_ids);
    RETURN v_count;
END;
$$;


-- Fold one channel's pending deltas now, waiting for its row lock: after an operator changes a
-- channel's limits (a cap added to a busy channel must count the completions not folded yet,
-- and a rate limit removed must not leave the channel due later). The channel row is locked
-- before its deltas, in the lock order every statement follows. Returns how many were folded.
-- The operator may just have resumed the channel or raised its cap, and the ORM's update
-- made it claimable already, so the tag is lifted here whether it was claimable or not: to
-- the virtual time of the other channels (a channel that is the smallest tag of all loses at
-- most the lead it had over the next one, bounded by one charge). Harmless when fairness is
-- by count (the tag is then unused), so it does not depend on the mode.
CREATE OR REPLACE FUNCTION fairqueue_fold_channel_v1(p_channel_id bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_vnow double precision;
    v_group bigint;
    s record;
BEGIN
    -- The channel, then its group (the lock order: channel rows, then group rows).
    SELECT c.group_id INTO v_group FROM fairqueue_channel c WHERE c.id = p_channel_id FOR UPDATE;
    IF v_group IS NOT NULL THEN
        PERFORM FROM fairqueue_channel_group g WHERE g.id = v_group FOR UPDATE;
    END IF;
    IF v_group IS NULL THEN
        v_vnow := fairqueue_virtual_time_v1(p_channel_id);
    ELSE
        v_vnow := fairqueue_group_virtual_time_v1(v_group, p_channel_id);
        -- the channel's new limits may make it due sooner than the group was parked for
        UPDATE fairqueue_channel_group g
        SET next_turn_at = least(g.next_turn_at, greatest(
            statement_timestamp(),
            coalesce(g.last_claimed_at + g.release_interval, '-infinity'::timestamptz)))
        WHERE g.id = v_group;
    END IF;
    WITH gone AS (
        DELETE FROM fairqueue_channel_delta d
        WHERE d.channel_id = p_channel_id
        RETURNING d.ready, d.scheduled, d.running, d.failed, d.succeeded, d.batch_pending,
                  d.run_seconds, d.run_count
    )
    SELECT coalesce(sum(ready), 0) AS ready, coalesce(sum(scheduled), 0) AS scheduled,
           coalesce(sum(running), 0) AS running, coalesce(sum(failed), 0) AS failed,
           coalesce(sum(succeeded), 0) AS succeeded,
           coalesce(bool_or(batch_pending), false) AS batches,
           coalesce(sum(run_seconds), 0) AS run, coalesce(sum(run_count), 0) AS runs,
           coalesce(sum(run_count) FILTER (WHERE run_seconds > 0), 0) AS ran,
           count(*)::integer AS n
    INTO s
    FROM gone;
    IF v_group IS NOT NULL AND s.runs > 0 THEN
        -- its group's tag too, before the channel's mean moves (as fairqueue_fold_deltas_v1)
        PERFORM fairqueue_correct_groups_v1(ARRAY[p_channel_id], ARRAY[s.run], ARRAY[s.runs]);
    END IF;
    UPDATE fairqueue_channel c
    SET ready_count = c.ready_count + s.ready,
        scheduled_count = c.scheduled_count + s.scheduled,
        running_count = c.running_count + s.running,
        failed_count = c.failed_count + s.failed,
        succeeded_total = c.succeeded_total + s.succeeded,
        batch_pending = c.batch_pending OR s.batches,
        next_turn_at = CASE  -- as in fairqueue_fold_deltas_v1
            WHEN c.release_interval = interval '0' AND c.next_turn_at > statement_timestamp()
                THEN statement_timestamp()
            ELSE c.next_turn_at
        END,
        -- lifted, and at most one message's charge ahead (as fairqueue_lift_v1)
        vtime = fairqueue_lift_v1(
            c.vtime + (s.run - s.runs * coalesce(c.mean_run, fairqueue_default_run_v1()))
                      / c.weight,
            v_vnow, false, true,
            fairqueue_charge_v1(fairqueue_mean_run_v1(c.mean_run, s.run, s.ran), c.weight)),
        mean_run = fairqueue_mean_run_v1(c.mean_run, s.run, s.ran)
    WHERE c.id = p_channel_id;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    RETURN s.n;
END;
$$;
