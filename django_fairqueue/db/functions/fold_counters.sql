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


-- Of the channels p_ids (rows this transaction holds), those no enqueue holds the name of, at
-- this moment: each name's lock taken exclusively without waiting. Every enqueue holds its
-- channel's name (a shared lock, fairqueue_channel_lock_key_v1) from before it reads the
-- channel's count until it commits, so for these no enqueue that may have written a quiet
-- delta (fairqueue_delta_wakes_v1) is in flight: a statement after this one sees every quiet
-- delta there is. With p_hold, the names stay held to the end of this transaction (at most
-- 128: the bound the name stripes keep on PostgreSQL's shared lock table; the rest are left
-- as if held), so an enqueue that comes after waits for our commit and then finds the
-- channel's count as we leave it: for a claim about to drain the channels, past its last wait
-- for a held channel (it may still wait for the maintenance loop's fold, which never waits),
-- in a transaction of its own (a caller's would keep enqueues waiting to its end). Without,
-- each is released at once: enough for a fold that only adds the quiet deltas, as an enqueue
-- that comes after reads a count of zero (and wakes) or one that makes the channel claimable.
-- None above READ COMMITTED (a snapshot older than the locks would not see what committed
-- before them). Ordered by id (the lock order).
CREATE OR REPLACE FUNCTION fairqueue_free_names_v1(p_ids bigint[], p_hold boolean)
RETURNS bigint[]
LANGUAGE plpgsql
SET enable_seqscan = off  -- (a lock attempt per row read: primary-key lookups only)
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN NULL;
    ELSIF p_hold THEN
        -- (the 128 chosen first, behind OFFSET 0, and only they tried: a lock attempt in the
        -- same query's WHERE ran on every row before the sort and the limit)
        RETURN ARRAY(
            SELECT x.id FROM (
                SELECT c.id, c.name FROM fairqueue_channel c
                WHERE c.id = ANY (p_ids)
                ORDER BY c.id
                LIMIT 128 OFFSET 0
            ) x
            WHERE pg_try_advisory_xact_lock(fairqueue_channel_lock_key_v1(), hashtext(x.name))
            ORDER BY x.id);
    END IF;
    RETURN ARRAY(
        SELECT c.id FROM fairqueue_channel c
        WHERE c.id = ANY (p_ids)
          AND CASE WHEN pg_try_advisory_lock(fairqueue_channel_lock_key_v1(), hashtext(c.name))
                   THEN pg_advisory_unlock(fairqueue_channel_lock_key_v1(), hashtext(c.name))
                   ELSE false END
        ORDER BY c.id);
END;
$$;


-- Count the committed quiet deltas (fairqueue_delta_wakes_v1) of channels p_ids, whose rows
-- this transaction holds, into their ready_count: for a claim about to take all they count
-- (fairqueue_claim_v1, step 3b). First, with p_own (the claim is its own transaction, past its
-- last wait for a held channel), the names of those no enqueue holds, to the commit
-- (fairqueue_free_names_v1): o_free, for which no enqueue that may write one is in flight
-- either, so the claim leaves no marker should it drain them. o_ids and o_added: the channels
-- it added to, and how many. Deleting a quiet delta may wait, briefly, for the maintenance
-- loop's fold, the only one that holds deltas before their channel (it never waits itself).
CREATE OR REPLACE FUNCTION fairqueue_count_quiet_v1(
    p_ids bigint[], p_own boolean,
    OUT o_free bigint[], OUT o_ids bigint[], OUT o_added integer[]
)
LANGUAGE plpgsql
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
BEGIN
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    IF p_own THEN
        o_free := fairqueue_free_names_v1(p_ids, true);
    END IF;
    WITH gone AS (
        DELETE FROM fairqueue_channel_delta d
        WHERE d.channel_id = ANY (p_ids) AND d.ready > 0 AND NOT d.wake  -- (quiet index)
        RETURNING d.channel_id, d.ready
    ), s AS MATERIALIZED (
        SELECT gone.channel_id, sum(gone.ready)::integer AS added
        FROM gone GROUP BY gone.channel_id
    ), counted AS (
        UPDATE fairqueue_channel c
        SET ready_count = c.ready_count + s.added
        FROM s
        WHERE c.id = s.channel_id AND c.id = ANY (p_ids)
        RETURNING c.id, s.added
    )
    SELECT array_agg(counted.id), array_agg(counted.added)
    INTO o_ids, o_added
    FROM counted;
END;
$$;


-- Fold pending counter deltas into their channel rows. With p_wake_only, only deltas that may
-- make a channel claimable (new ready messages for a channel that counts none; freed slots of
-- a capped channel) are folded: the claim does this before picking channels. The others
-- (completions on uncapped channels, quiet enqueues: fairqueue_delta_wakes_v1) change no
-- eligibility, so the maintenance loop folds them in bulk (p_wake_only = false), one channel
-- update per channel per pass instead of one per completed batch. With p_drained, the
-- `drained` markers instead, with their channels' quiet deltas (step 2c): the claim's
-- housekeeping, after its fold of waking deltas, and the maintenance loop's.
-- A fold that lowers a channel's count to zero or below (removals) leaves a marker for it
-- (step 3): quiet deltas, some perhaps of enqueues in flight, may count what still waits.
-- Only deltas whose channel row can be locked right now are folded (SKIP LOCKED on both): a
-- channel locked by a concurrent claim is folded by that claim, so nobody waits here (but for
-- the drained mode's delete of quiet deltas, step 2c).
-- Returns how many delta rows were folded.
-- enable_seqscan = off: on a small channel table the planner prefers a sequential scan to a
-- hundred primary-key lookups, which is cheaper there but makes the fold's cost grow with the
-- number of channels; we want it to grow with the number of deltas only, at any size.
-- Every fold adds the run time settlements recorded to the channel's mean (`mean_run`). With
-- p_by_time (fairness by time) it also corrects the tags, the channel's and its group's (the
-- claim charged the mean; the delta says what really ran), and lifts each channel it makes
-- servable to its queue's virtual time (fairqueue_queue_virtual_time_v1, read once per queue
-- per call, before the update).
CREATE OR REPLACE FUNCTION fairqueue_fold_deltas_v1(
    p_limit integer, p_wake_only boolean, p_by_time boolean DEFAULT false,
    p_drained boolean DEFAULT false
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
    v_vqueues text[];
    v_vnows double precision[];
    v_markers bigint[];  -- p_drained: the markers read, their channels, and of those the
    v_marked bigint[];   -- ones whose names no enqueue held a moment ago
    v_free bigint[];
    v_count integer;
BEGIN
    -- 1. Lock the oldest pending deltas. Two statements rather than `d.wake OR NOT
    --    p_wake_only`, so the first can use the partial index fq_delta_wake_idx. No probe of
    --    that index first: the callers make it (the claim's first statement probes it with
    --    the rest of its housekeeping), and call this only when it found a waking delta.
    --    (Markers do not wake: p_drained folds them, found by the index that keeps them one
    --    per channel, fq_delta_drained_uniq. Read without a lock: a marker is deleted only by the
    --    holder of its channel's row, step 3. Its channel is folded when no enqueue holds its
    --    name right now (fairqueue_free_names_v1, let go at once), or when it has committed
    --    quiet deltas to count whatever the name, or is gone (the marker is then deleted in
    --    step 2); the others are left untouched, no row locked, for a later fold.)
    IF p_drained THEN
        SELECT array_agg(x.id), array_agg(x.channel_id)
        INTO v_markers, v_marked FROM (
            SELECT d.id, d.channel_id FROM fairqueue_channel_delta d
            WHERE d.drained ORDER BY d.channel_id LIMIT p_limit
        ) x;
        IF v_markers IS NULL THEN
            RETURN 0;
        END IF;
        v_free := fairqueue_free_names_v1(v_marked, false);
        v_deltas := v_markers;
        v_delta_channels := v_marked;
        v_wanted := ARRAY(
            SELECT m.id FROM unnest(v_marked) AS m(id)
            WHERE m.id = ANY (v_free)
               OR EXISTS (SELECT FROM fairqueue_channel_delta q  -- (quiet index)
                          WHERE q.channel_id = m.id AND q.ready > 0 AND NOT q.wake)
               OR NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = m.id));
        IF cardinality(v_wanted) = 0 THEN
            RETURN 0;
        END IF;
    ELSIF p_wake_only THEN
        SELECT array_agg(x.id), array_agg(x.channel_id), array_agg(DISTINCT x.channel_id)
        INTO v_deltas, v_delta_channels, v_wanted FROM (
            SELECT d.id, d.channel_id FROM fairqueue_channel_delta d
            WHERE d.wake ORDER BY d.id LIMIT p_limit FOR UPDATE SKIP LOCKED
        ) x;
    ELSE
        SELECT array_agg(x.id), array_agg(x.channel_id), array_agg(DISTINCT x.channel_id)
        INTO v_deltas, v_delta_channels, v_wanted FROM (
            SELECT d.id, d.channel_id FROM fairqueue_channel_delta d
            WHERE NOT d.drained ORDER BY d.id LIMIT p_limit FOR UPDATE SKIP LOCKED
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

    -- The deltas of the locked channels, worked out from step 1's arrays, so the DELETE below
    -- names rows by primary key only: with `AND d.channel_id = ANY (v_locked)` in it, a
    -- generic plan sometimes took fq_delta_channel_idx and read every pending delta of those
    -- channels (the maintenance loop's non-waking ones included: 5,010 rows to delete 10; in
    -- steady traffic 6.4 of a claim of 100's 10.8 ms). tests/test_explain.py checks. (Every
    -- channel locked, the usual case: they are step 1's deltas, no statement.)
    IF cardinality(v_locked) < cardinality(v_wanted) THEN
        v_deltas := ARRAY(
            SELECT x.id FROM unnest(v_deltas, v_delta_channels) AS x(id, channel_id)
            WHERE x.channel_id = ANY (v_locked)
        );
    END IF;
    -- 2c. Drained channels (p_drained): the committed quiet deltas of every channel locked,
    --     and the markers of those whose names were free (no enqueue that may write one was
    --     in flight then: this statement, after those locks, sees all there are). Deleting a
    --     quiet delta may wait, briefly, for the maintenance loop's fold, the only one that
    --     holds deltas before their channel (it never waits itself).
    IF p_drained THEN
        -- (the names again, now that the rows are ours: between step 1 and step 2 a name
        -- found free may have been taken by an enqueue whose channel a claim then drained,
        -- its marker this one)
        v_free := fairqueue_free_names_v1(ARRAY(
            SELECT x.id FROM unnest(v_locked) AS x(id) WHERE x.id = ANY (v_free)), false);
        v_deltas := ARRAY(
            SELECT m.id FROM unnest(v_markers, v_marked) AS m(id, channel_id)
            WHERE m.channel_id = ANY (v_free) AND m.channel_id = ANY (v_locked)
            UNION ALL
            SELECT d.id FROM fairqueue_channel_delta d
            WHERE d.channel_id = ANY (v_locked) AND d.ready > 0 AND NOT d.wake  -- (quiet index)
        );
        IF cardinality(v_deltas) = 0 THEN
            RETURN 0;
        END IF;
    END IF;
    IF p_by_time THEN
        -- the virtual time of each queue of the ungrouped channels among them (one, usually)
        SELECT array_agg(q.queue), array_agg(fairqueue_queue_virtual_time_v1(q.queue, NULL, NULL))
        INTO v_vqueues, v_vnows
        FROM (
            SELECT DISTINCT c.queue::text AS queue FROM fairqueue_channel c
            WHERE c.id = ANY (v_locked) AND c.group_id IS NULL
        ) q;
        -- 2c. The groups of grouped channels among them (locked in step 2b), by what really
        --     ran, before step 3 moves the means their claims charged. A group that becomes
        --     claimable in step 3 is then lifted from its corrected tag (its trigger).
        IF v_groups IS NOT NULL THEN
            PERFORM fairqueue_correct_groups_v1(s.ids, s.run, s.runs)
            FROM (
                SELECT array_agg(x.channel_id) AS ids, array_agg(x.run) AS run,
                       array_agg(x.runs) AS runs
                FROM (
                    SELECT d.channel_id, sum(d.run_seconds)::double precision AS run,
                           sum(d.run_count)::bigint AS runs
                    FROM fairqueue_channel_delta d
                    WHERE d.id = ANY (v_deltas)
                    GROUP BY d.channel_id
                ) x
            ) s;
        END IF;
    END IF;

    -- 3. Delete those deltas, sum them per channel and add the sums to the channels, in one
    --    statement: primary-key lookups on both tables (enable_seqscan = off keeps the join of
    --    the sums to the channels on the key at any size).
    WITH gone AS (
        DELETE FROM fairqueue_channel_delta d
        WHERE d.id = ANY (v_deltas)
        RETURNING d.channel_id, d.ready, d.scheduled, d.running, d.failed, d.succeeded,
                  d.batch_pending, d.run_seconds, d.run_count
    ), g AS MATERIALIZED (
        SELECT gone.channel_id, sum(gone.ready) AS ready, sum(gone.scheduled) AS scheduled,
               sum(gone.running) AS running, sum(gone.failed) AS failed,
               sum(gone.succeeded) AS succeeded, bool_or(gone.batch_pending) AS batches,
               sum(gone.run_seconds) AS run, sum(gone.run_count) AS runs,
               -- the mean learns from messages that ran, not from releases (nothing ran)
               coalesce(sum(gone.run_count) FILTER (WHERE gone.run_seconds > 0), 0) AS ran,
               count(*) AS n
        FROM gone
        GROUP BY gone.channel_id
    ), added AS (
        UPDATE fairqueue_channel c
        SET ready_count = c.ready_count + g.ready,
            scheduled_count = c.scheduled_count + g.scheduled,
            running_count = c.running_count + g.running,
            failed_count = c.failed_count + g.failed,
            succeeded_total = c.succeeded_total + g.succeeded,
            -- set by whatever made a work batch pending (plan, retry, failure, release,
            -- rescue); cleared only by a batch claim holding the row that finds none pending
            batch_pending = c.batch_pending OR g.batches,
            -- A channel without a rate limit is never due later than now. Its turn can only be
            -- in the future when the database clock stepped back (the turn was set by the old
            -- clock) or an operator removed its rate limit: either would park it until the
            -- clock caught up. Folding is what makes a channel claimable, so this is where it
            -- is put right (at the front of the round: a one-off, not a way to jump the
            -- queue). The start of the statement, not the clock now: the claim calling this
            -- compares turns with the clock it read before.
            next_turn_at = CASE
                WHEN c.release_interval = interval '0' AND c.next_turn_at > statement_timestamp()
                    THEN statement_timestamp()
                ELSE c.next_turn_at
            END,
            -- The tag: the claim charged the mean run time per message; add what really ran
            -- minus that (divided by the weight). A channel this fold makes servable (it was
            -- not: no ready message, at its cap, or in slow start, its first message running
            -- with no run time known) is lifted to its queue's virtual time.
            vtime = CASE WHEN NOT p_by_time THEN c.vtime ELSE fairqueue_lift_v1(
                c.vtime + (g.run - g.runs * coalesce(c.mean_run, fairqueue_default_run_v1()))
                          / c.weight,
                -- a grouped channel is lifted within its group
                CASE WHEN c.group_id IS NULL
                     THEN v_vnows[array_position(v_vqueues, c.queue::text)]
                     ELSE fairqueue_group_virtual_time_v1(c.group_id, c.id) END,
                c.claimable AND (c.mean_run IS NOT NULL OR c.running_count = 0),
                c.ready_count + g.ready > 0 AND NOT c.paused
                    AND (c.max_concurrency IS NULL
                         OR c.running_count + g.running < c.max_concurrency)
                    AND (g.ran > 0 OR c.mean_run IS NOT NULL
                         OR c.running_count + g.running = 0),
                -- at most one message's charge ahead (its mean as this fold leaves it)
                fairqueue_charge_v1(fairqueue_mean_run_v1(c.mean_run, g.run, g.ran), c.weight))
            END,
            mean_run = fairqueue_mean_run_v1(c.mean_run, g.run, g.ran)
        FROM g
        WHERE c.id = g.channel_id AND c.id = ANY (v_locked)
        RETURNING c.id, c.ready_count, g.ready
    ), lowered AS (
        -- removals brought the count to zero or below: a marker, as a claim that takes all a
        -- channel counts leaves one (fairqueue_claim_v1, step 5)
        INSERT INTO fairqueue_channel_delta (channel_id, wake, drained)
        SELECT added.id, false, true FROM added
        WHERE added.ready < 0 AND added.ready_count <= 0
        ON CONFLICT DO NOTHING  -- (one marker a channel: fq_delta_drained_uniq)
    )
    -- (`lowered` is not read: PostgreSQL runs every data-modifying CTE to completion.)
    SELECT sum(g.n) INTO v_count FROM g;
    RETURN coalesce(v_count, 0);
END;
$$;


-- Whether more than p_beyond waking counter deltas wait: a walk of at most that many entries of
-- fq_delta_wake_idx. A claim folds the oldest thousand itself; a work-batch claim that found
-- nothing asks this, and folds the rest when there are more (batches._fold_backlog). Never a
-- sequential scan: a plan made while the table had no pages read every pending delta.
CREATE OR REPLACE FUNCTION fairqueue_waking_backlog_v1(p_beyond integer)
RETURNS boolean
LANGUAGE plpgsql
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
BEGIN
    RETURN EXISTS (
        SELECT FROM fairqueue_channel_delta d WHERE d.wake ORDER BY d.id OFFSET p_beyond
    );
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
    v_queue text;
    v_ready integer;
    s record;
BEGIN
    -- The channel, then its group (the lock order: channel rows, then group rows).
    SELECT c.group_id, c.queue::text INTO v_group, v_queue
    FROM fairqueue_channel c WHERE c.id = p_channel_id FOR UPDATE;
    IF v_group IS NOT NULL THEN
        PERFORM FROM fairqueue_channel_group g WHERE g.id = v_group FOR UPDATE;
    END IF;
    IF v_group IS NULL THEN
        v_vnow := fairqueue_queue_virtual_time_v1(v_queue, p_channel_id, NULL);
    ELSE
        v_vnow := fairqueue_group_virtual_time_v1(v_group, p_channel_id);
        -- the channel's new limits may make it due sooner than the group was parked for
        UPDATE fairqueue_channel_group g
        SET next_turn_at = fairqueue_woken_turn_v1(g.next_turn_at, g.last_claimed_at,
                                                   g.release_interval, statement_timestamp())
        WHERE g.id = v_group;
    END IF;
    WITH gone AS (
        DELETE FROM fairqueue_channel_delta d
        WHERE d.channel_id = p_channel_id
          AND NOT d.drained  -- (a claim's fold takes it: fairqueue_fold_deltas_v1, drained mode)
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
    WHERE c.id = p_channel_id
    RETURNING c.ready_count INTO v_ready;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF s.ready < 0 AND v_ready <= 0 THEN  -- lowered to nothing: a marker, as the fold leaves
        INSERT INTO fairqueue_channel_delta (channel_id, wake, drained)
        VALUES (p_channel_id, false, true)
        ON CONFLICT DO NOTHING;  -- (one marker a channel: fq_delta_drained_uniq)
    END IF;
    RETURN s.n;
END;
$$;
