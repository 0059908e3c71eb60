-- django-fairqueue: server-side functions, version 1.
--
-- Installed with CREATE OR REPLACE by migrations (0002 first), each from its own never-edited
-- copy of this file, migrations/sql/<migration name>.sql. Editing this file changes no database:
-- add a migration that installs a copy of the edited file (see migrations/_sql.py);
-- tests/test_migrations.py fails until a fully migrated database has exactly these functions.
-- A later incompatible change adds functions_v2.sql with new names (fairqueue_claim_v2, ...) so
-- old and new workers can run side by side during a rolling deploy; v1 is dropped one release
-- later.
--
-- Locking rules (see docs/explanation/fairness.md, "Why it cannot deadlock"):
--   * A channel row is written only by fairqueue_claim_v1 (under FOR UPDATE SKIP LOCKED, so a
--     claim never waits for a channel) and by operators' edits. Everything else records counter
--     changes in fairqueue_channel_delta, which the claim folds in.
--   * Message rows are locked FOR UPDATE SKIP LOCKED by claims, and by UPDATE/DELETE ... WHERE
--     lease_token = ... by settlements; a settlement touches only rows its claim owns.
--   * Enqueue takes an advisory lock per *bounded* channel (max_backlog set), in channel id
--     order, so concurrent batches to overlapping channels cannot deadlock.

-- Advisory-lock namespace for bounded-backlog enqueue: ("fq" as int, channel id).
CREATE OR REPLACE FUNCTION fairqueue_lock_key_v1() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 26225 $$;


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
    -- Every claim calls this, and almost always nothing is due. One probe of fq_message_due_idx
    -- settles that for about a fifth of what the writing statement below costs even when it
    -- writes nothing (measured with track_functions: 68 us of a 181 us empty claim).
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
CREATE OR REPLACE FUNCTION fairqueue_fold_deltas_v1(p_limit integer, p_wake_only boolean)
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
    v_ids bigint[];
    v_ready bigint[];
    v_scheduled bigint[];
    v_running bigint[];
    v_failed bigint[];
    v_succeeded bigint[];
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
    SELECT array_agg(x.id ORDER BY x.id) INTO v_locked FROM (
        SELECT c.id FROM fairqueue_channel c
        WHERE c.id = ANY (v_wanted) ORDER BY c.id FOR UPDATE SKIP LOCKED
    ) x;
    IF v_locked IS NULL THEN
        RETURN 0;
    END IF;

    -- 3. Delete the deltas of the locked channels and sum them per channel. Which deltas
    --    those are is worked out from step 1's arrays, so the DELETE names rows by primary
    --    key only: with `AND d.channel_id = ANY (v_locked)` in it, a generic plan sometimes
    --    took fq_delta_channel_idx and read every pending delta of those channels (the
    --    maintenance loop's non-waking ones included: 5,010 rows to delete 10; in steady
    --    traffic 6.4 of a claim of 100's 10.8 ms). tests/test_explain.py checks.
    v_deltas := ARRAY(
        SELECT x.id FROM unnest(v_deltas, v_delta_channels) AS x(id, channel_id)
        WHERE x.channel_id = ANY (v_locked)
    );
    WITH gone AS (
        DELETE FROM fairqueue_channel_delta d
        WHERE d.id = ANY (v_deltas)
        RETURNING d.channel_id, d.ready, d.scheduled, d.running, d.failed, d.succeeded
    ), g AS (
        SELECT gone.channel_id, sum(gone.ready) AS ready, sum(gone.scheduled) AS scheduled,
               sum(gone.running) AS running, sum(gone.failed) AS failed,
               sum(gone.succeeded) AS succeeded, count(*) AS n
        FROM gone
        GROUP BY gone.channel_id
    )
    SELECT array_agg(g.channel_id ORDER BY g.channel_id), array_agg(g.ready ORDER BY g.channel_id),
           array_agg(g.scheduled ORDER BY g.channel_id), array_agg(g.running ORDER BY g.channel_id),
           array_agg(g.failed ORDER BY g.channel_id), array_agg(g.succeeded ORDER BY g.channel_id),
           sum(g.n)
    INTO v_ids, v_ready, v_scheduled, v_running, v_failed, v_succeeded, v_count
    FROM g;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;

    -- 4. Add the sums: primary-key lookups, each row's sums found by its array position.
    UPDATE fairqueue_channel c
    SET ready_count = c.ready_count + v_ready[array_position(v_ids, c.id)],
        scheduled_count = c.scheduled_count + v_scheduled[array_position(v_ids, c.id)],
        running_count = c.running_count + v_running[array_position(v_ids, c.id)],
        failed_count = c.failed_count + v_failed[array_position(v_ids, c.id)],
        succeeded_total = c.succeeded_total + v_succeeded[array_position(v_ids, c.id)]
    WHERE c.id = ANY (v_ids);
    RETURN v_count;
END;
$$;


-- The fair claim. Returns up to p_limit messages, spread over channels in round-robin order,
-- each channel within its concurrency cap, rate limit and weight, highest priority first within
-- a channel. Every returned row carries a fresh lease_token that later writes must present.
--
--   1. promote due scheduled messages and fold waking counter deltas (bounded, skip locks;
--      skipped with p_maintain = false);
--   2. lock up to p_limit eligible channels in turn order (index fq_channel_turn_idx):
--      eligible = ready_count > 0, not paused, under its cap, next_turn_at <= now;
--   3. share p_limit among them by weighted water-filling (deficit round-robin in memory);
--   4. claim each channel's share from fq_message_ready_idx, SKIP LOCKED;
--   5. charge the channels: running_count, ready_count, and the next turn.
--
-- Cost: steps 2-5 touch only the chosen channels and the rows claimed; nothing scans the
-- backlog, so the cost is flat in the number of queued messages and grows with the number of
-- channels one call serves (at most p_limit).
CREATE OR REPLACE FUNCTION fairqueue_claim_v1(
    p_limit integer,
    p_lease interval,
    p_worker text,
    p_only bigint[] DEFAULT NULL,
    p_exclude bigint[] DEFAULT NULL,
    p_quantum integer DEFAULT NULL,
    p_maintain boolean DEFAULT true,
    p_wait_ms integer DEFAULT 0
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
    v_ids bigint[] := '{}';
    v_names text[] := '{}';
    v_turn integer[] := '{}';
    v_used integer[] := '{}';
    v_room integer[] := '{}';
    v_interval interval[] := '{}';
    v_alloc integer[];
    v_last integer[];  -- when each channel was last given messages in this claim (sequence)
    v_seq integer := 0;
    v_n integer := 0;
    v_covered integer := 0;
    v_left integer;
    v_give integer;
    v_progress boolean;
    v_round integer := 0;
    v_waited boolean := false;
    v_wait_until timestamptz;
    v_lock_timeout text;
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
    IF p_maintain THEN
        PERFORM fairqueue_promote_due_v1(v_now, 1000);
        PERFORM fairqueue_fold_deltas_v1(1000, true);
    END IF;

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
    -- this statement fail with SQLSTATE 55P03; store.py then reports no messages (and redoes
    -- a completion of the same call on its own). So only a caller in a transaction of its own
    -- may wait. No deadlock can last: this transaction's other locks were taken with SKIP
    -- LOCKED or are on its own leased messages, and lock_timeout, far below deadlock_timeout,
    -- ends a wait on a channel locked by another claim's counter fold.
    LOOP
        IF NOT v_waited THEN
            OPEN v_cur FOR
                SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                       c.ready_count, c.max_concurrency, c.running_count
                FROM fairqueue_channel c
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                  AND c.next_turn_at <= v_now
                  AND (p_only IS NULL OR c.id = ANY (p_only))
                  AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
                ORDER BY c.next_turn_at, c.id
                LIMIT p_limit
                FOR UPDATE SKIP LOCKED;
        ELSE
            OPEN v_cur FOR
                SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                       c.ready_count, c.max_concurrency, c.running_count
                FROM fairqueue_channel c
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
            -- the most this call may take: ready rows, free slots, one release if rate limited
            v_room[v_n] := LEAST(
                r.ready_count,
                coalesce(r.max_concurrency - r.running_count, p_limit),
                CASE WHEN r.release_interval > interval '0' THEN 1 ELSE p_limit END);
            v_interval[v_n] := r.release_interval;
            v_covered := v_covered + LEAST(v_turn[v_n] - v_used[v_n], v_room[v_n]);
            EXIT WHEN v_covered >= p_limit;
        END LOOP;
        CLOSE v_cur;
        IF v_waited THEN
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            v_now := clock_timestamp();  -- for the charge, claimed_at and the lease
            EXIT;
        END IF;
        EXIT WHEN v_n > 0 OR coalesce(p_wait_ms, 0) <= 0;
        v_waited := true;
        v_wait_until := clock_timestamp() + p_wait_ms * interval '1 millisecond';
        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
    END LOOP;

    IF v_n = 0 THEN
        RETURN;
    END IF;

    -- Step 3. Weighted water-filling in turn order. Round 0 gives each channel what is left of
    -- its current turn; later rounds (only when the channels found could not cover p_limit)
    -- give a whole turn each. Earlier channels get the remainder of a partial round, exactly
    -- as a sequence of smaller claims would.
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

    -- Steps 4 and 5 in one statement. The LATERAL subquery reads each channel's head from
    -- fq_message_ready_idx and stops after its share. No row locks are needed there: ready
    -- messages of a channel are only ever claimed by the holder of that channel's row lock,
    -- which we took in step 2, and this statement's snapshot was taken after we got it, so it
    -- sees every earlier claim of the channel as committed. (Locking each row first cost a WAL
    -- record and a page write per message for nothing.) The UPDATE re-checks state = 'ready'
    -- against an operator deleting or cancelling a message meanwhile. Channels are charged
    -- with what was actually claimed (`got`), which may be less than their share.
    RETURN QUERY
    WITH alloc AS (
        SELECT a.cid, a.n FROM unnest(v_ids, v_alloc) AS a(cid, n)
    ), cand AS (
        SELECT h.id
        FROM alloc
        CROSS JOIN LATERAL (
            SELECT m.id
            FROM fairqueue_message m
            WHERE m.channel_id = alloc.cid AND m.state = 'ready'
            ORDER BY m.priority DESC, m.id
            LIMIT alloc.n
        ) h
        WHERE alloc.n > 0
    ), claimed AS (
        UPDATE fairqueue_message m
        SET state = 'running',
            attempts = m.attempts + 1,
            lease_token = gen_random_uuid(),
            lease_expires_at = v_now + p_lease,
            claimed_at = v_now,
            worker_id = p_worker
        -- = ANY(ARRAY(...)) makes this a primary-key lookup. A join to `cand` lets the planner
        -- guess thousands of rows for `LIMIT alloc.n` and hash a sequential scan of the whole
        -- message table (seen: 12 ms at 20k rows, linear in the backlog).
        WHERE m.id = ANY (ARRAY(SELECT cand.id FROM cand)) AND m.state = 'ready'
        RETURNING m.id, m.channel_id, m.task_name, m.payload, m.priority, m.attempts,
                  m.max_attempts, m.keep_result, m.lease_token, m.lease_expires_at,
                  m.enqueued_at, m.run_at
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
            END
        FROM got
        WHERE c.id = got.cid AND c.id = ANY (v_ids)  -- primary-key lookups, as above
        RETURNING c.id
    )
    SELECT claimed.id, claimed.channel_id, v_names[array_position(v_ids, claimed.channel_id)],
           claimed.task_name::text,
           claimed.payload, claimed.priority, claimed.attempts::integer,
           claimed.max_attempts::integer, claimed.keep_result, claimed.lease_token,
           claimed.lease_expires_at, claimed.enqueued_at, claimed.run_at
    FROM claimed
    ORDER BY claimed.id;
    -- (`charged` is not read: PostgreSQL runs every data-modifying CTE to completion.)
END;
$$;


-- Settle successful messages given as parallel arrays (id, lease token, result): delete them,
-- or keep them as succeeded with their result when the message asked for it. Returns the ids
-- actually settled: a row whose lease token is not the caller's (expired and claimed again,
-- or cancelled) is left alone, and frees no slot.
-- A function rather than a prepared statement for its plan_cache_mode: as a prepared
-- statement it was re-planned on every call (see fairqueue_claim_v1), which cost more server
-- time than the settlement itself for small batches.
CREATE OR REPLACE FUNCTION fairqueue_complete_v1(
    p_ids bigint[],
    p_tokens uuid[],
    p_results jsonb[]
)
RETURNS SETOF bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- Lease tokens are random per claim, so "the row's current token is one the caller holds"
    -- is the (id, token) match without a join (a join to unnest() is planned as a nested loop).
    -- Nothing here says `state = 'running'`: a token exists exactly while a row runs (CHECK
    -- fq_message_lease_iff_running), and a state condition would be answered with the partial
    -- index of running rows, scanning all of them instead of primary-key lookups.
    RETURN QUERY
    WITH gone AS (
        DELETE FROM fairqueue_message m
        WHERE m.id = ANY (p_ids)
          AND m.lease_token = ANY (p_tokens)
          AND NOT m.keep_result
        RETURNING m.id, m.channel_id
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
        RETURNING m.id, m.channel_id
    ), settled AS (
        SELECT * FROM gone UNION ALL SELECT * FROM kept
    ), delta AS (
        -- The concurrency slot is freed here, once: only rows this statement settled count.
        -- It wakes the claim only for capped channels; other channels fold it in maintenance.
        INSERT INTO fairqueue_channel_delta (channel_id, running, succeeded, wake)
        SELECT s.channel_id, -count(*), count(*),
               (SELECT c.max_concurrency IS NOT NULL
                FROM fairqueue_channel c WHERE c.id = s.channel_id)
        FROM settled s GROUP BY s.channel_id
    )
    SELECT settled.id FROM settled;
END;
$$;


-- Complete messages and claim the next ones in one transaction (one round trip, one commit):
-- what a claimer that has just finished messages would otherwise do in two. The completion
-- runs first, so the slots it frees on capped channels are claimable by this very claim (its
-- fold sees the completion's deltas). Rows with `settled` true are the completed ids (every
-- other column NULL), then come the claimed messages as fairqueue_claim_v1 returns them.
-- Locks: the completion locks only rows the caller's leases own; the claim waits for nothing
-- (SKIP LOCKED), so the pair cannot deadlock where the two alone could not.
CREATE OR REPLACE FUNCTION fairqueue_complete_and_claim_v1(
    p_ids bigint[],
    p_tokens uuid[],
    p_results jsonb[],
    p_limit integer,
    p_lease interval,
    p_worker text,
    p_only bigint[] DEFAULT NULL,
    p_exclude bigint[] DEFAULT NULL,
    p_quantum integer DEFAULT NULL,
    p_wait_ms integer DEFAULT 0
)
RETURNS TABLE (
    settled boolean,
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
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    IF cardinality(p_ids) > 0 THEN
        RETURN QUERY
        SELECT true, done.id, NULL::bigint, NULL::text, NULL::text, NULL::jsonb,
               NULL::smallint, NULL::integer, NULL::integer, NULL::boolean, NULL::uuid,
               NULL::timestamptz, NULL::timestamptz, NULL::timestamptz
        FROM fairqueue_complete_v1(p_ids, p_tokens, p_results) AS done(id);
    END IF;
    RETURN QUERY
    SELECT false, c.id, c.channel_id, c.channel_name, c.task_name, c.payload, c.priority,
           c.attempts, c.max_attempts, c.keep_result, c.lease_token, c.lease_expires_at,
           c.enqueued_at, c.run_at
    FROM fairqueue_claim_v1(p_limit, p_lease, p_worker, p_only, p_exclude, p_quantum, true,
                             p_wait_ms) AS c;
END;
$$;


-- Enqueue a batch in one round trip. Arrays are parallel, one element per message.
-- Channels are created on first use with the given defaults. For channels with a max_backlog,
-- an advisory lock per channel (taken in channel id order, so concurrent batches cannot
-- deadlock) serialises enqueuers of that channel only, and the backlog is checked under it;
-- a full channel raises SQLSTATE FQ001 and nothing of the batch is inserted.
-- Returns the new message ids in input order.
CREATE OR REPLACE FUNCTION fairqueue_enqueue_v1(
    p_channels text[],
    p_tasks text[],
    p_payloads jsonb[],
    p_priorities smallint[],
    p_run_at timestamptz[],
    p_max_attempts integer[],
    p_keep_result boolean[],
    p_default_max_concurrency integer,
    p_default_release_interval interval,
    p_default_weight integer,
    p_default_max_backlog integer,
    p_notify_channel text
)
RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_names text[];
    v_found integer;
    v_bounded record;
    v_backlog bigint;
BEGIN
    SELECT array_agg(DISTINCT n ORDER BY n) INTO v_names FROM unnest(p_channels) AS n;

    -- Resolve channel ids, creating missing channels in name order. A new statement sees rows
    -- committed by concurrent creators, which ON CONFLICT DO NOTHING waited for.
    SELECT count(*) INTO v_found FROM fairqueue_channel c WHERE c.name = ANY (v_names);
    IF v_found < array_length(v_names, 1) THEN
        INSERT INTO fairqueue_channel AS c (
            name, max_concurrency, release_interval, weight, paused, max_backlog,
            next_turn_at, turn_used, ready_count, scheduled_count, running_count,
            failed_count, succeeded_total, created_at
        )
        SELECT n, p_default_max_concurrency, p_default_release_interval, p_default_weight,
               false, p_default_max_backlog, v_now, 0, 0, 0, 0, 0, 0, v_now
        FROM unnest(v_names) AS n
        ORDER BY n
        ON CONFLICT (name) DO NOTHING;
    END IF;

    -- Bounded channels: serialise their enqueuers and check room for this batch.
    FOR v_bounded IN
        SELECT c.id, c.name, c.max_backlog, want.n
        FROM fairqueue_channel c
        JOIN (SELECT n AS name, count(*) AS n FROM unnest(p_channels) AS n GROUP BY n) want
          ON want.name = c.name
        WHERE c.name = ANY (v_names) AND c.max_backlog IS NOT NULL
        ORDER BY c.id
    LOOP
        PERFORM pg_advisory_xact_lock(fairqueue_lock_key_v1(), (v_bounded.id % 2147483647)::integer);
        -- Counters as committed now (new snapshot after the lock) plus deltas not yet folded.
        SELECT c.ready_count + c.scheduled_count
               + coalesce((SELECT sum(d.ready + d.scheduled)
                           FROM fairqueue_channel_delta d WHERE d.channel_id = c.id), 0)
        INTO v_backlog
        FROM fairqueue_channel c WHERE c.id = v_bounded.id;
        IF v_backlog + v_bounded.n > v_bounded.max_backlog THEN
            RAISE EXCEPTION 'fairqueue: channel % is full (backlog %, max_backlog %, batch %)',
                quote_literal(v_bounded.name), v_backlog, v_bounded.max_backlog, v_bounded.n
                USING ERRCODE = 'FQ001',
                      DETAIL = json_build_object(
                          'channel', v_bounded.name, 'backlog', v_backlog,
                          'max_backlog', v_bounded.max_backlog, 'batch', v_bounded.n)::text;
        END IF;
    END LOOP;

    RETURN QUERY
    WITH input AS (
        SELECT t.ord, c.id AS cid, t.task, t.payload, t.priority,
               coalesce(t.run_at, v_now) AS run_at, t.max_attempts, t.keep_result
        FROM unnest(p_channels, p_tasks, p_payloads, p_priorities, p_run_at, p_max_attempts,
                    p_keep_result)
             WITH ORDINALITY AS t(channel, task, payload, priority, run_at, max_attempts,
                                  keep_result, ord)
        JOIN fairqueue_channel c ON c.name = t.channel
    ), inserted AS (
        INSERT INTO fairqueue_message (
            channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
            max_attempts, keep_result, worker_id
        )
        SELECT cid, task, payload, priority,
               CASE WHEN run_at > v_now THEN 'scheduled' ELSE 'ready' END,
               run_at, v_now, 0, max_attempts, keep_result, ''
        FROM input
        ORDER BY ord
        RETURNING fairqueue_message.id, fairqueue_message.channel_id, fairqueue_message.state
    ), delta AS (
        INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running, failed, succeeded)
        SELECT inserted.channel_id,
               count(*) FILTER (WHERE inserted.state = 'ready'),
               count(*) FILTER (WHERE inserted.state = 'scheduled'),
               0, 0, 0
        FROM inserted
        GROUP BY inserted.channel_id
        RETURNING 1
    )
    -- ids come from the sequence in insertion order, which follows `ord`
    -- (`delta` is not read: PostgreSQL runs every data-modifying CTE to completion.)
    SELECT inserted.id FROM inserted ORDER BY inserted.id;

    -- One wake-up per transaction at most: PostgreSQL folds identical notifications of a
    -- transaction into one, so a batch (or a view enqueueing many times) notifies once.
    -- And only when an idle worker may be waiting: not when the batch has one channel whose
    -- head became ready over 50 ms ago. Nobody idle took it (workers are busy, or the channel
    -- is capped, paused or rate limited), and busy workers claim again as they settle, so the
    -- notification would only cost: NOTIFY serialises commits on a cluster-wide lock and wakes
    -- every listener. A fresher head may be being claimed right now by a claim that cannot see
    -- this batch yet: that still notifies. The head is read like the claim reads it (ORDER BY
    -- and LIMIT 1 on fq_message_ready_idx): one index probe. Batches of several channels
    -- (rare, and notifying once for many messages) always notify: with the names as an array
    -- the planner cannot settle on a generic plan and re-plans on every call.
    IF p_notify_channel IS NOT NULL AND (
        array_length(v_names, 1) > 1
        OR NOT EXISTS (
            SELECT 1
            FROM fairqueue_channel c
            CROSS JOIN LATERAL (
                SELECT m.run_at
                FROM fairqueue_message m
                WHERE m.channel_id = c.id AND m.state = 'ready'
                ORDER BY m.priority DESC, m.id
                LIMIT 1
            ) head
            WHERE c.name = v_names[1]
              AND head.run_at < v_now - interval '50 milliseconds'
        )
    ) THEN
        PERFORM pg_notify(p_notify_channel, '');
    END IF;
END;
$$;
