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
-- Lock order (docs/explanation/fairness.md, "Lock order"); every statement follows it:
--   1. advisory locks on channel names, shared (enqueue) or exclusive (deleting a channel);
--   2. fairqueue_channel rows, in id order. Claims (messages and work batches), the fold and
--      the repair write counters and turns; operators write only configuration columns (the
--      Django model maps no other). Claims and the fold never wait for a channel row: they
--      use SKIP LOCKED (a claim's bounded CLAIM_WAIT ends in lock_timeout, not a deadlock);
--   3. fairqueue_channel_group rows: the group of a channel, after the channel, by whoever
--      writes a grouped channel's counters (fairqueue_group_counters_v1); claims lock a group
--      SKIP LOCKED (or under CLAIM_WAIT's lock_timeout) and its channels SKIP LOCKED;
--   4. fairqueue_channel_delta rows: inserted by every writer of messages, deleted by the fold
--      and the repair, which lock them SKIP LOCKED or after the channel;
--   5. fairqueue_message and fairqueue_work_batch rows, in id order within one statement.
--      Claims lock ready rows SKIP LOCKED (they never wait on a message), settlements only
--      rows their lease token owns;
--   6. the bounded-backlog advisory locks, taken only while the transaction commits, all at
--      once in channel id order (fairqueue_backlog_check_v1).
-- Nothing takes a lock of an earlier rank while it waits for a later one, except a caller's
-- own transaction doing so across statements, which the SKIP LOCKED waits above tolerate.

-- Advisory-lock namespace of the bounded-backlog check at commit: ("fq" as int, channel id).
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


-- Fairness by time (FAIRQUEUE['FAIRNESS'] = 'time'; docs/explanation/fairness.md, "Fairness by
-- time"). Each channel carries `vtime`, its virtual start tag: the seconds of worker time it
-- was charged, divided by its weight. The claim serves the claimable channel with the smallest
-- tag (index fq_channel_vtime_idx) and charges it the channel's mean run time per message
-- (`mean_run`, FAIRQUEUE_DEFAULT_RUN when unknown); the settlement's delta carries the time
-- the messages really ran, and the fold puts the difference right. A channel that becomes
-- claimable (new work after being idle, a freed slot, unpaused) is lifted to the system's
-- virtual time, so it cannot bank credit while it was away.

-- The estimate charged per message of a channel with no recorded run time yet (seconds).
CREATE OR REPLACE FUNCTION fairqueue_default_run_v1() RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 0.01::double precision $$;


-- Channel groups (docs/explanation/fairness.md, "Groups of channels"). A channel may belong to
-- a group (fairqueue_channel.group_id); the claim is fair across the top-level flows first
-- (groups, and ungrouped channels, each of which is a flow of its own), then across the
-- channels of a group. A group row carries the operator's weight, cap and rate limit and the
-- group's scheduler state, which only the functions below write: ready_count, running_count
-- (the sums of its channels' columns), claimable (how many of its channels are claimable by
-- their counters), next_turn_at, turn_used, vtime, last_claimed_at.

-- The top-level virtual time (fairqueue_virtual_time_v1, below), other than channel p_exclude
-- and group p_exclude_group.
CREATE OR REPLACE FUNCTION fairqueue_top_virtual_time_v1(
    p_exclude bigint, p_exclude_group bigint
)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    -- The tag indexes lead with the queue (docs/howto/queues.md): the smallest tag is the
    -- smallest of each queue's first entry, found queue after queue (one probe per queue).
    SELECT coalesce(
        least(
            (WITH RECURSIVE q AS (
                (SELECT c.queue::text AS queue, c.vtime
                 FROM fairqueue_channel c
                 WHERE c.ready_count > 0
                   AND NOT c.paused
                   AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                   AND c.group_id IS NULL
                   AND c.id IS DISTINCT FROM p_exclude
                 ORDER BY c.queue, c.vtime, c.id
                 LIMIT 1)
                UNION ALL
                SELECT n.queue, n.vtime
                FROM q CROSS JOIN LATERAL (
                    SELECT c.queue::text AS queue, c.vtime
                    FROM fairqueue_channel c
                    WHERE c.ready_count > 0
                   AND NOT c.paused
                   AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                   AND c.group_id IS NULL
                      AND c.queue > q.queue
                      AND c.id IS DISTINCT FROM p_exclude
                    ORDER BY c.queue, c.vtime, c.id
                    LIMIT 1) n)
             SELECT min(q.vtime) FROM q),
            (WITH RECURSIVE q AS (
                (SELECT g.queue::text AS queue, g.vtime
                 FROM fairqueue_channel_group g
                 WHERE g.claimable > 0
                   AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                   AND g.id IS DISTINCT FROM p_exclude_group
                 ORDER BY g.queue, g.vtime, g.id
                 LIMIT 1)
                UNION ALL
                SELECT n.queue, n.vtime
                FROM q CROSS JOIN LATERAL (
                    SELECT g.queue::text AS queue, g.vtime
                    FROM fairqueue_channel_group g
                    WHERE g.claimable > 0
                      AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                      AND g.queue > q.queue
                      AND g.id IS DISTINCT FROM p_exclude_group
                    ORDER BY g.queue, g.vtime, g.id
                    LIMIT 1) n)
             SELECT min(q.vtime) FROM q)),
        nullif(greatest(
            (SELECT max(c.vtime) FROM fairqueue_channel c
             WHERE c.vtime > 0 AND c.group_id IS NULL AND c.id IS DISTINCT FROM p_exclude),
            (SELECT max(g.vtime) FROM fairqueue_channel_group g
             WHERE g.vtime > 0 AND g.id IS DISTINCT FROM p_exclude_group)), 0),
        0)
$$;


-- The system virtual time: the smallest tag of a claimable top-level flow, other than
-- p_exclude: an ungrouped channel (the first entry of fq_channel_vtime_idx, its predicate
-- repeated word for word) or a channel group (fq_group_vtime_idx). When nothing is claimable,
-- the largest tag of any of them (fq_channel_vtime_max_idx, fq_group_vtime_max_idx): after
-- the queue went idle every flow starts level with the most served one, so a channel that was
-- idle longest cannot come back ahead of one that ran recently. Index probes, no lock.
-- (Those indexes hold only tags above 0: by count no tag moves, so claims and folds by count
-- add nothing to them; a largest tag of 0 is the same as none.)
-- Channels of a group have tags of their own, compared only within their group
-- (fairqueue_group_virtual_time_v1).
CREATE OR REPLACE FUNCTION fairqueue_virtual_time_v1(p_exclude bigint DEFAULT NULL)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    SELECT fairqueue_top_virtual_time_v1(p_exclude, NULL)
$$;


-- The virtual time inside group p_group, other than channel p_exclude: the smallest tag of a
-- claimable channel of the group (fq_channel_in_group_vtime_idx), else the largest tag of any
-- of its channels (fq_channel_group_idx). Index probes, no lock.
CREATE OR REPLACE FUNCTION fairqueue_group_virtual_time_v1(p_group bigint, p_exclude bigint)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT c.vtime FROM fairqueue_channel c
         WHERE c.group_id IS NOT NULL
           AND c.ready_count > 0
           AND NOT c.paused
           AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
           AND c.group_id = p_group
           AND c.id IS DISTINCT FROM p_exclude
         ORDER BY c.vtime, c.id
         LIMIT 1),
        (SELECT c.vtime FROM fairqueue_channel c
         WHERE c.group_id IS NOT NULL AND c.group_id = p_group
           AND c.id IS DISTINCT FROM p_exclude
         ORDER BY c.vtime DESC
         LIMIT 1),
        0)
$$;


-- Queues (docs/howto/queues.md): named pools of work, orthogonal to channels. A channel row
-- belongs to one queue: the channel "acme" of queue "reports" is the row named
-- 'reports' || chr(31) || 'acme' (chr(31), the unit separator, is refused in the names the
-- API takes), and its queue column says 'reports'. The default queue's rows are named as
-- channels always were. A group is per queue the same way (the group 'reports' || chr(31) ||
-- 'acme' holds the channels 'reports' || chr(31) || 'acme/...'). The claim's indexes lead
-- with the queue, so a claim walks one queue's flows only.

-- The queue a channel or group row name declares: the part before chr(31), else 'default'.
CREATE OR REPLACE FUNCTION fairqueue_queue_of_name_v1(p_name text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN strpos(p_name, chr(31)) > 1 THEN split_part(p_name, chr(31), 1)
                ELSE 'default' END
$$;


-- A row's queue follows its name, whoever writes it (an enqueue creating the channel, the
-- admin, a fixture).
CREATE OR REPLACE FUNCTION fairqueue_set_queue_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.queue := fairqueue_queue_of_name_v1(NEW.name);
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_channel_queue ON fairqueue_channel;
CREATE TRIGGER fairqueue_channel_queue
    BEFORE INSERT OR UPDATE OF name, queue ON fairqueue_channel
    FOR EACH ROW
    WHEN (NEW.queue IS DISTINCT FROM fairqueue_queue_of_name_v1(NEW.name))
    EXECUTE FUNCTION fairqueue_set_queue_v1();

DROP TRIGGER IF EXISTS fairqueue_group_queue ON fairqueue_channel_group;
CREATE TRIGGER fairqueue_group_queue
    BEFORE INSERT OR UPDATE OF name, queue ON fairqueue_channel_group
    FOR EACH ROW
    WHEN (NEW.queue IS DISTINCT FROM fairqueue_queue_of_name_v1(NEW.name))
    EXECUTE FUNCTION fairqueue_set_queue_v1();


-- The queues among p_queues that have a claimable flow (an ungrouped channel or a group), each
-- with the turn of its first flow: the claim of several queues serves the one that has waited
-- longest first. Two index probes per queue, no lock; rate-limited flows whose turn is still to
-- come count (their claim finds nothing).
CREATE OR REPLACE FUNCTION fairqueue_claimable_queues_v1(p_queues text[])
RETURNS TABLE (queue_name text, first_turn timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan  -- see fairqueue_claim_v1
AS $$
BEGIN
    RETURN QUERY
    SELECT t.q, t.first_turn
    FROM (
        SELECT n.q,
               least(
                   (SELECT c.next_turn_at
                    FROM fairqueue_channel c
                    WHERE c.ready_count > 0
                      AND NOT c.paused
                      AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                      AND c.group_id IS NULL
                      AND c.queue = n.q
                    ORDER BY c.next_turn_at, c.id
                    LIMIT 1),
                   (SELECT g.next_turn_at
                    FROM fairqueue_channel_group g
                    WHERE g.claimable > 0
                      AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                      AND g.queue = n.q
                    ORDER BY g.next_turn_at, g.id
                    LIMIT 1)) AS first_turn
        FROM unnest(p_queues) AS n(q)
    ) t
    WHERE t.first_turn IS NOT NULL;
END;
$$;


-- The group a channel name declares: the part before its first '/', when both parts are
-- non-empty ('acme/alice' -> 'acme'); NULL otherwise.
CREATE OR REPLACE FUNCTION fairqueue_group_of_name_v1(p_name text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN strpos(p_name, '/') > 1 AND strpos(p_name, '/') < length(p_name)
                THEN split_part(p_name, '/', 1) END
$$;


-- A new channel named '<group>/<rest>' joins the group of that name if it exists, whoever
-- creates it (an enqueue, the admin, a fixture). A name with '/' whose group does not exist
-- stays ungrouped: grouping is declared by creating the group (enqueue's tuple form, the
-- admin), never by a name alone, so channels named 'user/42' before groups existed keep
-- behaving as they did.
CREATE OR REPLACE FUNCTION fairqueue_channel_join_group_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT g.id INTO NEW.group_id
    FROM fairqueue_channel_group g
    WHERE g.name = fairqueue_group_of_name_v1(NEW.name);
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_channel_join_group ON fairqueue_channel;
CREATE TRIGGER fairqueue_channel_join_group
    BEFORE INSERT ON fairqueue_channel
    FOR EACH ROW
    WHEN (NEW.group_id IS NULL AND strpos(NEW.name, '/') > 1)
    EXECUTE FUNCTION fairqueue_channel_join_group_v1();


-- A channel's name is its identity: enqueues find the channel by it, and it says which group
-- the channel belongs to. A group's name says which channels are its own. So neither changes
-- once the row exists, whatever writes it: Model.save(), QuerySet.update(), bulk_update(),
-- loaddata over an existing row. (`UPDATE OF name`: only statements that set the name run
-- the trigger; the claims and folds, which never do, pay nothing.) To move a tenant's work
-- elsewhere, enqueue to a channel of the new name.
CREATE OR REPLACE FUNCTION fairqueue_keep_name_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'fairqueue: a % keeps its name: % cannot become %',
        TG_ARGV[0], quote_literal(OLD.name), quote_literal(NEW.name)
        USING ERRCODE = '55000',
              HINT = 'A name is the identity enqueues use; create one of the new name instead.';
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_channel_keep_name ON fairqueue_channel;
CREATE TRIGGER fairqueue_channel_keep_name
    BEFORE UPDATE OF name ON fairqueue_channel
    FOR EACH ROW
    WHEN (OLD.name IS DISTINCT FROM NEW.name)
    EXECUTE FUNCTION fairqueue_keep_name_v1('channel');

DROP TRIGGER IF EXISTS fairqueue_group_keep_name ON fairqueue_channel_group;
CREATE TRIGGER fairqueue_group_keep_name
    BEFORE UPDATE OF name ON fairqueue_channel_group
    FOR EACH ROW
    WHEN (OLD.name IS DISTINCT FROM NEW.name)
    EXECUTE FUNCTION fairqueue_keep_name_v1('channel group');


-- A new group takes in the ungrouped channels its name declares ('acme' takes 'acme/...').
-- Once per group; a scan of the channel names (no index answers a prefix under every
-- collation). The counters move with them (fairqueue_group_counters_v1).
CREATE OR REPLACE FUNCTION fairqueue_group_attach_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fairqueue_channel c
    SET group_id = NEW.id
    WHERE c.group_id IS NULL AND fairqueue_group_of_name_v1(c.name) = NEW.name;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_group_attach ON fairqueue_channel_group;
CREATE TRIGGER fairqueue_group_attach
    AFTER INSERT ON fairqueue_channel_group
    FOR EACH ROW
    EXECUTE FUNCTION fairqueue_group_attach_v1();


-- Create the groups of p_names that do not exist yet (enqueue's tuple form). Returns nothing.
CREATE OR REPLACE FUNCTION fairqueue_ensure_groups_v1(p_names text[])
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO fairqueue_channel_group AS g (
        name, weight, max_concurrency, release_interval, created_at
    )
    SELECT n, 1, NULL, interval '0', clock_timestamp()
    FROM unnest(p_names) AS n
    ORDER BY n
    ON CONFLICT (name) DO NOTHING
$$;


-- Keep a group's sums exact: every statement that changes a grouped channel's ready_count,
-- running_count, paused, max_concurrency or group (claims, folds, the repair, deleting a
-- channel, an operator's edit) moves the group's row with it, in the same transaction. So a
-- group's running_count is exactly the sum of its channels' (which lags behind settlements not
-- folded yet, never ahead of claims): the cap checked on it errs on the safe side, as a
-- channel's does. A channel that becomes claimable wakes its group: a group parked until a
-- rate-limited channel is due comes back at once (within its own rate limit), and a group
-- that had no claimable channel is lifted to the top-level virtual time (no banked credit;
-- harmless by count, where tags are unused).
-- Lock order: group rows come after channel rows (rank 3). The writers that wait (operators'
-- edits, fairqueue_fold_channel_v1, the repair, deletions, batch claims) hold the channel and
-- wait for its group, which a claim holds only until it commits. A claim locks a group before
-- its channels, but takes those SKIP LOCKED: it never waits for a channel while holding a
-- group (its one wait, CLAIM_WAIT, is bounded by lock_timeout). The fold takes both SKIP
-- LOCKED.
CREATE OR REPLACE FUNCTION fairqueue_group_counters_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_old boolean := false;
    v_new boolean := false;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        v_old := OLD.ready_count > 0 AND NOT OLD.paused
                 AND (OLD.max_concurrency IS NULL OR OLD.running_count < OLD.max_concurrency);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        v_new := NEW.ready_count > 0 AND NOT NEW.paused
                 AND (NEW.max_concurrency IS NULL OR NEW.running_count < NEW.max_concurrency);
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.group_id IS NOT DISTINCT FROM NEW.group_id THEN
        UPDATE fairqueue_channel_group g
        SET ready_count = g.ready_count + NEW.ready_count - OLD.ready_count,
            running_count = g.running_count + NEW.running_count - OLD.running_count,
            claimable = g.claimable + v_new::integer - v_old::integer,
            next_turn_at = CASE WHEN v_new AND NOT v_old THEN least(g.next_turn_at, greatest(
                statement_timestamp(),
                coalesce(g.last_claimed_at + g.release_interval, '-infinity'::timestamptz)))
                ELSE g.next_turn_at END,
            vtime = CASE WHEN v_new AND NOT v_old AND g.claimable = 0
                THEN fairqueue_lift_v1(g.vtime, fairqueue_top_virtual_time_v1(NULL, g.id), false,
                                       true, fairqueue_charge_v1(NEW.mean_run, g.weight))
                ELSE g.vtime END
        WHERE g.id = NEW.group_id;
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' AND OLD.group_id IS NOT NULL THEN
        UPDATE fairqueue_channel_group g
        SET ready_count = g.ready_count - OLD.ready_count,
            running_count = g.running_count - OLD.running_count,
            claimable = g.claimable - v_old::integer
        WHERE g.id = OLD.group_id;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.group_id IS NOT NULL THEN
        UPDATE fairqueue_channel_group g
        SET ready_count = g.ready_count + NEW.ready_count,
            running_count = g.running_count + NEW.running_count,
            claimable = g.claimable + v_new::integer,
            next_turn_at = CASE WHEN v_new THEN least(g.next_turn_at, greatest(
                statement_timestamp(),
                coalesce(g.last_claimed_at + g.release_interval, '-infinity'::timestamptz)))
                ELSE g.next_turn_at END,
            vtime = CASE WHEN v_new AND g.claimable = 0
                THEN fairqueue_lift_v1(g.vtime, fairqueue_top_virtual_time_v1(NULL, g.id), false,
                                       true, fairqueue_charge_v1(NEW.mean_run, g.weight))
                ELSE g.vtime END
        WHERE g.id = NEW.group_id;
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_group_counters ON fairqueue_channel;
CREATE TRIGGER fairqueue_group_counters
    AFTER UPDATE OF ready_count, running_count, paused, max_concurrency, group_id
    ON fairqueue_channel
    FOR EACH ROW
    WHEN ((OLD.group_id IS NOT NULL OR NEW.group_id IS NOT NULL)
          AND (OLD.ready_count, OLD.running_count, OLD.paused, OLD.max_concurrency,
               OLD.group_id)
              IS DISTINCT FROM (NEW.ready_count, NEW.running_count, NEW.paused,
                                NEW.max_concurrency, NEW.group_id))
    EXECUTE FUNCTION fairqueue_group_counters_v1();

DROP TRIGGER IF EXISTS fairqueue_group_counters_delete ON fairqueue_channel;
CREATE TRIGGER fairqueue_group_counters_delete
    AFTER DELETE ON fairqueue_channel
    FOR EACH ROW
    WHEN (OLD.group_id IS NOT NULL)
    EXECUTE FUNCTION fairqueue_group_counters_v1();


-- A channel's tag after a fold: p_tag, lifted to the virtual time p_vnow when the channel
-- becomes claimable (p_before false, p_after true), and then also brought down to at most
-- one message's charge (p_charge) ahead of the virtual time: it starts within
-- [p_vnow, p_vnow + p_charge]. The claim charges estimates in advance and the fold corrects
-- them, so tags can move down: a channel charged 10 ms per message before its first
-- settlements folded (a new channel of tasks that take microseconds) drops back by what it
-- was over-charged. A channel that went idle meanwhile keeps a tag measured against the
-- other's tag before that drop, and without this bound it came back that far behind: seconds
-- of virtual time, which at a charge of a microsecond per message is millions of the other's
-- messages before its next one. A channel that ran legitimately ahead when it went idle was
-- at most one claim's charge past the virtual time; what is given up is that claim's charge
-- beyond one message (within the documented bound) and any correction folded while idle.
CREATE OR REPLACE FUNCTION fairqueue_lift_v1(
    p_tag double precision, p_vnow double precision, p_before boolean, p_after boolean,
    p_charge double precision
)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_after AND NOT p_before AND p_vnow IS NOT NULL
                THEN greatest(p_vnow, least(p_tag, p_vnow + greatest(p_charge, 0)))
                ELSE p_tag END
$$;


-- A channel's charge per message by time: its mean run time (the default while it has
-- none; at least a microsecond) divided by its weight. The claim charges this in advance.
CREATE OR REPLACE FUNCTION fairqueue_charge_v1(p_mean double precision, p_weight integer)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT greatest(coalesce(p_mean, fairqueue_default_run_v1()), 1e-6) / greatest(p_weight, 1)
$$;


-- A channel's mean run time after p_runs more messages that ran p_run seconds in all: an
-- exponentially weighted mean, each message weighing 1/10 (so it follows a change of the
-- workload within a few dozen messages and shrugs off one outlier).
CREATE OR REPLACE FUNCTION fairqueue_mean_run_v1(
    p_mean double precision, p_run double precision, p_runs bigint
)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN coalesce(p_runs, 0) <= 0 THEN p_mean
        WHEN p_mean IS NULL THEN p_run / p_runs
        ELSE p_mean + (1 - power(0.9, p_runs)) * (p_run / p_runs - p_mean)
    END
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
-- p_by_time (fairness by time) it also corrects the tags (the claim charged the mean; the
-- delta says what really ran) and lifts each channel it makes claimable to the system's
-- virtual time (fairqueue_virtual_time_v1, read once per call, before the update).
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
    v_deltas := ARRAY(
        SELECT x.id FROM unnest(v_deltas, v_delta_channels) AS x(id, channel_id)
        WHERE x.channel_id = ANY (v_locked)
    );
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
            c.ready_count > 0 AND NOT c.paused
                AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency),
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


-- The fair claim with channel groups (called by fairqueue_claim_v1 when a group is
-- claimable; same arguments, its clock reading and its quantum). Two levels:
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
--   3. take the messages and charge the channels (as fairqueue_claim_v1), then the groups:
--      turn, rate limit and tag. The groups' counters move with their channels'
--      (fairqueue_group_counters_v1).
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
CREATE OR REPLACE FUNCTION fairqueue_claim_grouped_v1(
    p_limit integer,
    p_lease interval,
    p_worker text,
    p_only bigint[],
    p_exclude bigint[],
    p_quantum integer,
    p_wait_ms integer,
    p_by_time boolean,
    p_now timestamptz,
    p_queue text
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
                     WHERE c.ready_count > 0
                       AND NOT c.paused
                       AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                       AND c.group_id IS NULL
                       AND c.queue = p_queue
                       AND (c.release_interval = interval '0' OR c.next_turn_at <= v_due)
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
                     WHERE c.ready_count > 0
                       AND NOT c.paused
                       AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
                    WHERE c.id = t.fid AND c.ready_count > 0 AND NOT c.paused
                      AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                      AND c.group_id IS NULL
                      AND (c.release_interval = interval '0'
                           OR c.next_turn_at <= clock_timestamp())
                    FOR UPDATE;
                ELSE
                    SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                           c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                    INTO r FROM fairqueue_channel c
                    WHERE c.id = t.fid AND c.ready_count > 0 AND NOT c.paused
                      AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                      AND c.group_id IS NULL
                      AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
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
                v_room[v_n] := LEAST(
                    r.ready_count,
                    coalesce(r.max_concurrency - r.running_count, p_limit),
                    CASE WHEN r.release_interval > interval '0' THEN 1 ELSE p_limit END);
                v_interval[v_n] := r.release_interval;
                v_mean[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()), 1e-6);
                v_est[v_n] := v_mean[v_n] / r.weight;
                v_tag[v_n] := r.vtime;
                v_cg[v_n] := 0;
                v_next[v_n] := 0;
                v_top := v_top || v_n;
                v_turns := v_turns + v_turn[v_n];
                v_covered := v_covered + LEAST(v_turn[v_n] - v_used[v_n], v_room[v_n]);
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
                v_budget := LEAST(v_gturn[v_ng] - v_gused[v_ng], v_groom[v_ng],
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
                          AND c.ready_count > 0
                          AND NOT c.paused
                          AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                          AND c.group_id = gr.id
                          AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
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
                          AND c.ready_count > 0
                          AND NOT c.paused
                          AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
                    v_room[v_n] := LEAST(
                        r.ready_count,
                        coalesce(r.max_concurrency - r.running_count, p_limit),
                        CASE WHEN r.release_interval > interval '0' THEN 1 ELSE p_limit END);
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
                    v_gcap[v_ng] := v_gcap[v_ng] + LEAST(v_turn[v_n] - v_used[v_n], v_room[v_n]);
                    v_gcov := v_gcov + LEAST(v_turn[v_n] - v_used[v_n], v_room[v_n]);
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
                      AND c.ready_count > 0
                      AND NOT c.paused
                      AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
                      AND c.ready_count > 0
                      AND NOT c.paused
                      AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                      AND c.group_id = v_gids[k]
                      AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
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
                      AND c.ready_count > 0
                      AND NOT c.paused
                      AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
                v_room[v_n] := LEAST(
                    r.ready_count,
                    coalesce(r.max_concurrency - r.running_count, p_limit),
                    CASE WHEN r.release_interval > interval '0' THEN 1 ELSE p_limit END);
                v_interval[v_n] := r.release_interval;
                v_mean[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()), 1e-6);
                v_est[v_n] := v_mean[v_n] / r.weight;
                v_tag[v_n] := r.vtime;
                v_cg[v_n] := k;
                v_next[v_gtail[k]] := v_n;
                v_next[v_n] := v_gfirst[k];
                v_gtail[k] := v_n;
                v_gcount[k] := v_gcount[k] + 1;
                v_gcap[k] := v_gcap[k] + LEAST(v_turn[v_n] - v_used[v_n], v_room[v_n]);
            END LOOP;
            CLOSE v_gcur;
        END IF;
    END LOOP;

    IF v_n = 0 THEN
        RETURN;
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

    -- Take the messages and charge the channels, as fairqueue_claim_v1 does (its comments
    -- say why each part is written this way), then charge the groups with what their
    -- channels actually got.
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
            FOR UPDATE OF m SKIP LOCKED
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
        WHERE m.id = ANY (ARRAY(SELECT cand.id FROM cand)) AND m.state = 'ready'
        RETURNING m.id, m.channel_id, m.task_name, m.payload, m.priority, m.attempts,
                  m.max_attempts, m.keep_result, m.lease_token, m.lease_expires_at,
                  m.enqueued_at, m.run_at
    ), got AS MATERIALIZED (
        SELECT claimed.channel_id AS cid, count(*)::integer AS n,
               array_position(v_ids, claimed.channel_id) AS k
        FROM claimed
        GROUP BY claimed.channel_id
    ), charged AS (
        UPDATE fairqueue_channel c
        SET running_count = c.running_count + got.n,
            ready_count = c.ready_count - got.n,
            last_claimed_at = v_now,
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
            vtime = CASE WHEN p_by_time THEN c.vtime + got.n * v_est[got.k] ELSE c.vtime END
        FROM got
        WHERE c.id = got.cid AND c.id = ANY (v_ids)
        RETURNING c.id
    ), ggot AS MATERIALIZED (
        SELECT v_cg[got.k] AS gk, sum(got.n)::integer AS n,
               sum(got.n * v_mean[got.k]) AS charge
        FROM got
        WHERE v_cg[got.k] > 0
        GROUP BY v_cg[got.k]
    ), gcharged AS (
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
    ORDER BY claimed.priority DESC, claimed.id;
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
--
-- p_by_time (fairness by time): step 2 walks fq_channel_vtime_idx instead, smallest virtual
-- tag first, passing over rate-limited channels not due yet (the tag index cannot bound
-- them by time), and step 5 also charges each channel its mean run time per message claimed,
-- divided by its weight. Shares, caps, rate limits and locks are as in turn order.
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
    p_queues text[] DEFAULT NULL
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
    v_est double precision[] := '{}';  -- the tag's charge per message (by time)
    v_tag double precision[] := '{}';  -- the channels' tags as the walk locked them (by time)
    v_first_tag double precision;  -- the tag of the first channel the walk locked (by time)
    v_front double precision;  -- the smallest claimable tag plus one charge (by time)
    v_skipped integer := 0;  -- channels locked by the walk and given nothing (by time)
    v_kept_room integer[];
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
    v_got integer := 0;
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
        PERFORM fairqueue_fold_deltas_v1(1000, true, p_by_time);
    END IF;

    -- Queues (docs/howto/queues.md). A channel (and a group) belongs to one queue, and the
    -- walks below read one queue's entries only: the indexes they walk lead with `queue`, so
    -- a claim of queue A never reads a channel of queue B. p_queues names the queues this
    -- claim may serve (NULL: all). One queue: walk it. Several: the queues that have a
    -- claimable flow (fairqueue_claimable_queues_v1, two index probes per queue), the one
    -- whose first flow has waited longest first, each claimed in turn by a call of its own
    -- (without waiting for held channels: another queue may have work) until p_limit is met.
    -- None claimable: walk the first queue named, or 'default' (so that CLAIM_WAIT still
    -- waits for a channel a concurrent claim holds or has just folded).
    IF cardinality(p_queues) = 1 THEN
        v_queue := p_queues[1];
    ELSIF p_queues IS NULL THEN
        -- All queues. One statement reads the lowest and highest queue of a claimable flow
        -- (the first and last entries of the two turn indexes, no lock). It stands in for
        -- the group probe below, so a claim of every queue runs as many statements as a
        -- claim of one: no claimable group at all, and that probe is skipped. When the
        -- queues found agree, that is the one queue with work (a project with one queue,
        -- always), or none has work, and nothing more is read; the comparisons are PL/pgSQL
        -- expressions, not statements.
        SELECT (SELECT c.queue::text FROM fairqueue_channel c
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                  AND c.group_id IS NULL
                ORDER BY c.queue LIMIT 1),
               (SELECT c.queue::text FROM fairqueue_channel c
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                  AND c.group_id IS NULL
                ORDER BY c.queue DESC LIMIT 1),
               (SELECT g.queue::text FROM fairqueue_channel_group g
                WHERE g.claimable > 0
                  AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                ORDER BY g.queue LIMIT 1),
               (SELECT g.queue::text FROM fairqueue_channel_group g
                WHERE g.claimable > 0
                  AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                ORDER BY g.queue DESC LIMIT 1)
        INTO v_lo, v_hi, v_glo, v_ghi;
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
                 WHERE c.ready_count > 0
                   AND NOT c.paused
                   AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                   AND c.group_id IS NULL
                 ORDER BY c.queue
                 LIMIT 1)
                UNION ALL
                SELECT (SELECT c.queue::text
                        FROM fairqueue_channel c
                        WHERE c.ready_count > 0
                          AND NOT c.paused
                          AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
            FOREACH v_queue IN ARRAY v_queues LOOP
                RETURN QUERY SELECT * FROM fairqueue_claim_v1(
                    p_limit - v_got, p_lease, p_worker, p_only, p_exclude, v_quantum, false, 0,
                    p_by_time, ARRAY[v_queue]);
                GET DIAGNOSTICS v_n = ROW_COUNT;
                v_got := v_got + v_n;
                EXIT WHEN v_got >= p_limit;
            END LOOP;
            RETURN;
        END IF;
    END IF;

    -- A claim of every queue that found no claimable flow in any queue (an idle poll): no walk
    -- can find a channel, held or not (a channel a concurrent claim holds is claimable in its
    -- committed version, which the probe read). What a claim that may wait still waits for is
    -- a channel a concurrent claim has just folded (step 2c below, the same statements): wait
    -- for it, then walk its queue once with a new snapshot, without waiting again. Nothing
    -- being folded: nothing to claim.
    IF v_nothing THEN
        IF coalesce(p_wait_ms, 0) <= 0 THEN
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

    -- Channel groups: when a group is claimable now (one probe of fq_group_turn_idx; the
    -- ORDER BY keeps a generic plan on the index, where EXISTS was a sequential scan that
    -- reads every group not claimable), the claim walks groups and ungrouped channels together
    -- (fairqueue_claim_grouped_v1). Without groups, or while none is claimable, the walk below
    -- sees ungrouped channels only (their indexes hold no grouped channel), exactly as before
    -- groups existed.
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
        RETURN QUERY SELECT * FROM fairqueue_claim_grouped_v1(
            p_limit, p_lease, p_worker, p_only, p_exclude, v_quantum, p_wait_ms, p_by_time,
            v_now, v_queue);
        RETURN;
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
        IF p_by_time AND NOT v_waited THEN
            -- The same walk in tag order. The rate limit is a filter here, not an index
            -- bound: `release_interval = 0 OR` keeps the planner off fq_channel_turn_idx
            -- (a range scan there would have to sort every claimable channel by tag).
            OPEN v_cur FOR
                SELECT c.id, c.name::text AS name, c.weight, c.turn_used, c.release_interval,
                       c.ready_count, c.max_concurrency, c.running_count, c.mean_run, c.vtime
                FROM fairqueue_channel c
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                  AND c.group_id IS NULL
                  AND c.queue = v_queue
                  AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
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
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
                  AND c.group_id IS NULL
                  AND c.queue = v_queue
                  AND (c.release_interval = interval '0'
                       OR (c.next_turn_at <= v_wait_until
                           AND c.next_turn_at <= clock_timestamp()))
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
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
                WHERE c.ready_count > 0
                  AND NOT c.paused
                  AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
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
            -- the most this call may take: ready rows, free slots, one release if rate limited
            v_room[v_n] := LEAST(
                r.ready_count,
                coalesce(r.max_concurrency - r.running_count, p_limit),
                CASE WHEN r.release_interval > interval '0' THEN 1 ELSE p_limit END);
            v_interval[v_n] := r.release_interval;
            IF p_by_time THEN  -- (not computed by count: a function call per channel)
                v_tag[v_n] := r.vtime;
                IF v_n = 1 THEN
                    v_first_tag := r.vtime;
                END IF;
                v_est[v_n] := greatest(coalesce(r.mean_run, fairqueue_default_run_v1()), 1e-6)
                              / r.weight;
            END IF;
            v_covered := v_covered + LEAST(v_turn[v_n] - v_used[v_n], v_room[v_n]);
            EXIT WHEN v_covered >= p_limit;
        END LOOP;
        CLOSE v_cur;
        IF v_waited THEN
            -- Step 2c. Still nothing. A channel a concurrent claim has just folded is not
            -- eligible in our snapshots yet (its new messages were still deltas there), and that
            -- claim holds the channel row until it commits, even when it does not serve the
            -- channel: wait for it the same way (bounded by the same lock_timeout), if a waking
            -- delta is still to be seen. Then, as any wait may have let such a claim commit,
            -- walk once more with a new snapshot, which sees its fold.
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
            IF v_skipped > 0 AND v_n = v_skipped THEN
                v_room := v_kept_room;  -- the channel waited for was no longer claimable
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
            SELECT c.vtime + greatest(coalesce(c.mean_run, fairqueue_default_run_v1()), 1e-6)
                             / c.weight
            INTO v_front
            FROM fairqueue_channel c
            WHERE c.ready_count > 0
              AND NOT c.paused
              AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency)
              AND c.group_id IS NULL
              AND c.queue = v_queue
              AND (c.release_interval = interval '0' OR c.next_turn_at <= v_now)
              AND (p_only IS NULL OR c.id = ANY (p_only))
              AND (p_exclude IS NULL OR NOT (c.id = ANY (p_exclude)))
            ORDER BY c.vtime, c.id
            LIMIT 1;
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
        RETURN;
    END IF;

    -- Step 3, by time: each message goes to the channel whose next message would start at the
    -- smallest tag (its tag plus what this claim gave it already, at its charge per message),
    -- up to its room: a merge of the channels' sequences of start tags, one statement on the
    -- arrays. A channel far ahead in tag order gets nothing though the walk locked it (with
    -- turns it would get its turn, and a tenant of long tasks took a slot in every claim of
    -- several messages). Channels go to the back in walk order.
    IF p_by_time THEN
        SELECT array_agg(coalesce(g.n, 0)::integer ORDER BY o.k)
        INTO v_alloc
        FROM generate_series(1, v_n) AS o(k)
        LEFT JOIN (
            SELECT x.k, count(*) AS n
            FROM (
                SELECT a.k
                FROM unnest(v_tag, v_est, v_room) WITH ORDINALITY AS a(tag, est, room, k)
                CROSS JOIN LATERAL generate_series(0, LEAST(a.room, p_limit) - 1) AS s(i)
                ORDER BY a.tag + s.i * a.est, a.k
                LIMIT p_limit
            ) x
            GROUP BY x.k
        ) g ON g.k = o.k;
        v_last := ARRAY(SELECT generate_series(1, v_n));
        v_seq := v_n;
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

    -- Steps 4 and 5 in one statement. The LATERAL subquery reads each channel's head from
    -- fq_message_ready_idx and stops after its share. Ready messages of a channel are only
    -- ever claimed by the holder of that channel's row lock, which we took in step 2, and this
    -- statement's snapshot was taken after we got it, so it sees every earlier claim of the
    -- channel as committed. The rows are still locked, SKIP LOCKED: a ready row can be locked
    -- by someone else than a claim (cancel, delete, purge, an ORM update of the caller's),
    -- and a claim that waited for it while holding channel rows would deadlock with that
    -- transaction as soon as it wrote one of those channels. Skipping costs a lock record per
    -- claimed row; waiting could cost the whole fleet. The UPDATE re-checks state = 'ready'.
    -- Channels are charged with what was actually claimed (`got`), which may be less than
    -- their share.
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
            FOR UPDATE OF m SKIP LOCKED
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
            END,
            -- By time: charged in advance, the channel's mean run time per message (divided by
            -- its weight), so a channel of long tasks cannot take many before any settles; the
            -- settlements' deltas correct the estimate when folded.
            vtime = CASE WHEN p_by_time THEN c.vtime + got.n * v_est[got.k] ELSE c.vtime END
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
    -- In the order a worker should start them (it may prefetch more than it runs at once).
    ORDER BY claimed.priority DESC, claimed.id;
    -- (`charged` is not read: PostgreSQL runs every data-modifying CTE to completion.)
END;
$$;


-- Whether another message holds a unique key of a channel: one waiting (ready or scheduled:
-- fq_message_unique_idx answers it), or one running with scope 'active' (its hold row in
-- fairqueue_unique_hold names it). A unique job going back to the queue (a retry, a release,
-- a rescue of scope 'queued'; an operator's retry of a dead letter) whose key another message
-- took meanwhile is superseded by that message: it ends cancelled (or stays failed) rather
-- than queue twice. Not inlined (a subquery prevents it): callers test `unique_key IS NOT
-- NULL` first, so a message without a key never pays for the call. STABLE: it reads the
-- calling statement's snapshot; fairqueue_unique_rejoin_v1 checks again after the write.
CREATE OR REPLACE FUNCTION fairqueue_unique_key_held_v1(p_channel_id bigint, p_unique_key text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
               SELECT FROM fairqueue_message o
               WHERE o.channel_id = p_channel_id AND o.unique_key = p_unique_key
                 AND o.state IN ('ready', 'scheduled'))
        OR EXISTS (
               SELECT FROM fairqueue_unique_hold h
               JOIN fairqueue_message o ON o.id = h.message_id
               WHERE h.channel_id = p_channel_id AND h.unique_key = p_unique_key
                 AND o.channel_id = p_channel_id AND o.unique_key = p_unique_key
                 AND o.unique_scope = 'active' AND o.state = 'running')
$$;


-- The hold of a unique key by a message of scope 'active' while it runs.
--
-- fq_message_unique_idx covers waiting messages only (ready, scheduled), so the claim, which
-- takes a message out of it, writes no index entry whatever the scope. A message of scope
-- 'active' also keeps its key while it runs through a row of fairqueue_unique_hold,
-- (channel_id, unique_key) -> message_id, written when the message enters the queue (its
-- enqueue, a replace that gives a waiting holder the scope, an operator's retry) and never
-- by the claim, the settlements or the rescue. A hold row is live while the message it names
-- is of scope 'active' and ready, scheduled or running, with that channel and key; a row
-- whose message finished, failed or is gone holds nothing and is taken over by the next
-- message of scope 'active' that enters with the key (and deleted by the pruner once its
-- message is gone or finished for good). Invariant: every message of scope 'active' that is
-- ready, scheduled or running is named by its key's hold row.
--
-- fairqueue_unique_holder_v1 runs right after a keyed message p_id entered the index (its
-- insert, or its return to the queue), in the same transaction, and returns the id of another
-- message holding the key through a live hold row, or NULL. For a message of scope 'active'
-- it also makes the hold row name p_id (when it returns NULL). The caller must not keep p_id
-- in the queue when it returns an id.
--
-- Why after the write, and why it is enough at READ COMMITTED: p_id's index entry is in
-- place (uncommitted) before this runs, so no other message can enter the index with the key
-- until this transaction ends (its insert waits for ours), and a running holder can only
-- appear by a claim of a waiting message, which must be in the index: none can start holding
-- the key from now on. A holder that was claimed before p_id's insert committed its claim
-- before that insert passed the index (the insert waits for a transaction that is updating
-- the waiting row it meets), and its hold row was committed with its enqueue, earlier still;
-- each statement of this VOLATILE function takes a fresh snapshot, so it sees both. Checking
-- before the insert instead would miss a holder claimed between the check and the insert.
-- Under REPEATABLE READ or SERIALIZABLE the snapshot is the transaction's: the function then
-- locks the hold row (ON CONFLICT DO UPDATE on a row written after the snapshot is a
-- serialization failure) and locks a holder it finds stale (FOR SHARE: a serialization
-- failure if it changed after the snapshot), so what it read is still true; a holder its
-- snapshot shows waiting or running counts as holding.
--
-- Lock order: the hold row ranks after message rows (docs/explanation/fairness.md, "Lock
-- order"): callers have already locked or inserted the message rows they write. Nobody waits
-- for a hold row while holding another message's index entry of the same key (only the
-- transaction whose message is in the index writes that key's hold row), and the pruner
-- deletes hold rows it takes SKIP LOCKED.
CREATE OR REPLACE FUNCTION fairqueue_unique_holder_v1(
    p_channel_id bigint, p_unique_key text, p_id bigint, p_scope text
)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_holder bigint;
    v_live boolean;
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        IF p_scope = 'active' THEN
            -- Take the hold: a new row, or a row whose message holds no more.
            INSERT INTO fairqueue_unique_hold AS h (channel_id, unique_key, message_id)
            VALUES (p_channel_id, p_unique_key, p_id)
            ON CONFLICT (channel_id, unique_key) DO UPDATE SET message_id = excluded.message_id
            WHERE NOT EXISTS (
                SELECT FROM fairqueue_message o
                WHERE o.id = h.message_id AND o.channel_id = h.channel_id
                  AND o.unique_key = h.unique_key AND o.unique_scope = 'active'
                  AND o.state IN ('ready', 'scheduled', 'running'))
            RETURNING h.message_id INTO v_holder;
            IF FOUND THEN
                RETURN NULL;
            END IF;
            -- A live hold (the row is locked now: it cannot change before this commits).
            SELECT h.message_id INTO v_holder
            FROM fairqueue_unique_hold h
            WHERE h.channel_id = p_channel_id AND h.unique_key = p_unique_key;
            RETURN nullif(v_holder, p_id);
        END IF;
        SELECT o.id INTO v_holder
        FROM fairqueue_unique_hold h
        JOIN fairqueue_message o ON o.id = h.message_id
        WHERE h.channel_id = p_channel_id AND h.unique_key = p_unique_key AND o.id <> p_id
          AND o.channel_id = p_channel_id AND o.unique_key = p_unique_key
          AND o.unique_scope = 'active' AND o.state IN ('ready', 'scheduled', 'running');
        RETURN v_holder;
    END IF;
    -- REPEATABLE READ, SERIALIZABLE: lock the hold row first (or insert it).
    INSERT INTO fairqueue_unique_hold AS h (channel_id, unique_key, message_id)
    VALUES (p_channel_id, p_unique_key, p_id)
    ON CONFLICT (channel_id, unique_key) DO UPDATE SET message_id = h.message_id
    RETURNING h.message_id INTO v_holder;
    IF v_holder <> p_id THEN
        SELECT o.unique_scope = 'active' AND o.state IN ('ready', 'scheduled', 'running')
               AND o.channel_id = p_channel_id AND o.unique_key = p_unique_key
        INTO v_live
        FROM fairqueue_message o
        WHERE o.id = v_holder;
        IF v_live THEN
            RETURN v_holder;
        ELSIF FOUND THEN
            -- Stale as this snapshot shows it: still so? (A serialization failure if not.)
            PERFORM FROM fairqueue_message o WHERE o.id = v_holder FOR SHARE;
        END IF;
    END IF;
    IF p_scope = 'active' THEN
        UPDATE fairqueue_unique_hold h SET message_id = p_id
        WHERE h.channel_id = p_channel_id AND h.unique_key = p_unique_key
          AND h.message_id <> p_id;
    ELSIF v_holder = p_id THEN
        -- inserted only to lock the key's row: no hold of a message of scope 'queued'
        DELETE FROM fairqueue_unique_hold h
        WHERE h.channel_id = p_channel_id AND h.unique_key = p_unique_key;
    END IF;
    RETURN NULL;
END;
$$;


-- A keyed message p_id just went back to the queue (a retry, a release, a rescue, an
-- operator's retry of a dead letter: the statement's RETURNING calls this, after the row and
-- its index entry are written). If a running message of scope 'active' holds the key
-- (fairqueue_unique_holder_v1), the statement fails with a unique violation of
-- fq_message_unique_idx, as it would had that holder been waiting: the caller runs it again
-- (store._run_back_to_queue) and its fresh snapshot sees the holder, so the message is
-- superseded. A message of scope 'active' (re)takes its key's hold row.
CREATE OR REPLACE FUNCTION fairqueue_unique_rejoin_v1(
    p_channel_id bigint, p_unique_key text, p_id bigint, p_scope text
)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_holder bigint := fairqueue_unique_holder_v1(p_channel_id, p_unique_key, p_id, p_scope);
BEGIN
    IF v_holder IS NOT NULL THEN
        RAISE EXCEPTION 'fairqueue: message % holds unique key % of channel % while it runs',
            v_holder, quote_literal(p_unique_key), p_channel_id
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'fq_message_unique_idx',
                  TABLE = 'fairqueue_message';
    END IF;
    RETURN true;
END;
$$;


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
CREATE OR REPLACE FUNCTION fairqueue_complete_v1(
    p_ids bigint[],
    p_tokens uuid[],
    p_results jsonb[],
    p_runs double precision[] DEFAULT NULL
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


-- Channel existence: every enqueue holds a shared lock per channel name (in this namespace,
-- keyed by hashtext(name)) until its transaction ends, and deleting a channel takes the
-- exclusive one first. A deletion therefore waits for enqueues in flight (and then deletes
-- their messages too), and an enqueue that comes after it finds the name gone and creates the
-- channel anew: no message is ever left behind with a channel id that no longer exists.
-- Shared locks never conflict with each other, so enqueues cannot deadlock on them.
CREATE OR REPLACE FUNCTION fairqueue_channel_lock_key_v1() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 26227 $$;


-- Raise SQLSTATE FQ001 if a bounded channel of p_ids would hold more than its max_backlog
-- waiting messages with this transaction's p_batch[i] messages for it. The backlog is the
-- channel's counters plus the deltas not yet folded, as this statement sees them: everything
-- committed, and this transaction's own enqueues; p_included says whether the batch is among
-- them already (at commit) or not (before it is inserted). The error reports the backlog
-- without the batch, and the batch.
CREATE OR REPLACE FUNCTION fairqueue_check_backlog_v1(
    p_ids bigint[], p_batch bigint[], p_included boolean
)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT c.id, c.name, c.max_backlog,
               c.ready_count + c.scheduled_count
               + coalesce((SELECT sum(d.ready + d.scheduled)
                           FROM fairqueue_channel_delta d WHERE d.channel_id = c.id), 0)
               AS backlog,
               coalesce(p_batch[array_position(p_ids, c.id)], 0) AS extra
        FROM fairqueue_channel c
        WHERE c.id = ANY (p_ids) AND c.max_backlog IS NOT NULL
        ORDER BY c.id
    LOOP
        IF p_included THEN
            r.backlog := r.backlog - r.extra;
        END IF;
        IF r.backlog + r.extra > r.max_backlog THEN
            RAISE EXCEPTION 'fairqueue: channel % is full (backlog %, max_backlog %, batch %)',
                quote_literal(r.name), r.backlog, r.max_backlog, r.extra
                USING ERRCODE = 'FQ001',
                      DETAIL = json_build_object(
                          'channel', r.name, 'backlog', r.backlog,
                          'max_backlog', r.max_backlog, 'batch', r.extra)::text;
        END IF;
    END LOOP;
END;
$$;


-- The bound of max_backlog, checked when the enqueuing transaction commits (a deferred
-- constraint trigger on the delta rows enqueue marks with backlog_check). An enqueue inside a
-- transaction holds no lock for the bound; at commit, the transaction takes one advisory lock
-- per bounded channel it enqueued to, all at once and in channel id order, checks every one of
-- them with a fresh snapshot (which sees what earlier holders committed), and keeps the locks
-- for the moment of its commit only. Two transactions touching the same channels in opposite
-- orders can therefore not deadlock, however many enqueue() calls each made.
-- The channels to check, with how many messages the transaction enqueued to each, travel in
-- the transaction-local setting fairqueue.bounded as "id:n,id:n" (a savepoint rolled back takes
-- its part of the list with it, as it takes its deltas).
CREATE OR REPLACE FUNCTION fairqueue_backlog_check_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_batch bigint[];
    v_id bigint;
BEGIN
    SELECT array_agg(x.id ORDER BY x.id), array_agg(x.n ORDER BY x.id) INTO v_ids, v_batch
    FROM (
        SELECT split_part(e, ':', 1)::bigint AS id, sum(split_part(e, ':', 2)::bigint) AS n
        FROM unnest(string_to_array(nullif(current_setting('fairqueue.bounded', true), ''), ','))
             AS e
        GROUP BY 1
    ) x;
    IF v_ids IS NULL THEN
        RETURN NULL;  -- an earlier row's trigger of this transaction checked them all
    END IF;
    PERFORM set_config('fairqueue.bounded', '', true);
    FOREACH v_id IN ARRAY v_ids LOOP
        PERFORM pg_advisory_xact_lock(fairqueue_lock_key_v1(), (v_id % 2147483647)::integer);
    END LOOP;
    PERFORM fairqueue_check_backlog_v1(v_ids, v_batch, true);
    RETURN NULL;
END;
$$;


-- Unique jobs: the part of fairqueue_enqueue_v1 that runs when a batch carries unique keys
-- (p_keys, NULL elements for messages without one), after the channels exist and the names are
-- held. At most one message per (channel, unique key) holds the key: while it is ready or
-- scheduled (the partial unique index fq_message_unique_idx; the ON CONFLICT below repeats its
-- predicate word for word, which is how PostgreSQL matches the index), and while it runs too
-- when its scope is 'active' (its hold row: fairqueue_unique_holder_v1). A message whose key
-- is held is not inserted, and its policy decides (p_policies):
--   keep     return the holder's id;
--   replace  give a queued holder this message's task, payload, priority, run time and
--            limits, in place (same id, same place in its channel); a running holder is kept
--            as it is (a running task's arguments cannot change) and its id returned;
--   raise    SQLSTATE FQ003, with the holder in DETAIL; nothing of the batch is stored.
-- Race-free: the index admits one waiting holder whatever the interleaving; ON CONFLICT waits
-- for a concurrent inserter of the same key and then sees its row. A running holder of scope
-- 'active' is not in the index: the insert passes over keys whose live hold row its snapshot
-- sees, and after the insert the inserted keys are checked again (a holder claimed between
-- the snapshot and the insert; fairqueue_unique_holder_v1 says why after is enough): one
-- found makes the call start over, and the next attempt's snapshot sees it. Each look-up below
-- is a statement of its own, so its snapshot sees the holder the insert conflicted with
-- (committed after this statement began, perhaps). A holder that stops holding meanwhile
-- (claimed, with scope 'queued'; finished, cancelled) makes the call start over, its keys
-- given back.
-- Lock order: message rows (rank 5), then hold rows: a replace locks the queued holder it
-- rewrites; messages of scope 'active' write their keys' hold rows after every insert; a keep
-- locks nothing else, so an enqueue in a long transaction never holds up a worker. Keys are
-- inserted, hold rows written and held keys handled in (channel, key) order, so concurrent
-- batches cannot deadlock over them (separate calls in one transaction are the caller's order).
-- Returns the ids in input order (a kept or replaced message's id is its holder's).
CREATE OR REPLACE FUNCTION fairqueue_enqueue_unique_v1(
    p_channels text[],
    p_tasks text[],
    p_payloads jsonb[],
    p_priorities smallint[],
    p_run_at timestamptz[],
    p_max_attempts integer[],
    p_keep_result boolean[],
    p_delay interval[],
    p_keys text[],
    p_scopes text[],
    p_policies text[],
    p_now timestamptz,
    p_bounded bigint[]
)
RETURNS SETOF bigint
LANGUAGE plpgsql
-- Plan each statement once per session (see fairqueue_claim_v1): its parameters are arrays,
-- which PL/pgSQL would otherwise re-plan on every call.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_n integer := cardinality(p_payloads);
    v_cids bigint[];
    v_plain bigint[];
    v_kid bigint[];
    v_kch bigint[];
    v_kkey text[];
    v_kscope text[];
    v_out bigint[];
    v_id bigint;
    v_state text;
    v_new_state text;
    v_run_at timestamptz;
    v_policy text;
    v_scope text;
    v_tries integer;
    v_attempt integer;
    i integer;
BEGIN
    IF cardinality(p_keys) <> v_n THEN
        RAISE EXCEPTION 'fairqueue: % unique keys for % messages', cardinality(p_keys), v_n
            USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT FROM unnest(p_policies) AS x WHERE x NOT IN ('keep', 'replace', 'raise'))
    THEN
        RAISE EXCEPTION 'fairqueue: on_conflict must be keep, replace or raise, got %',
            p_policies USING ERRCODE = '22023';
    END IF;
    v_cids := ARRAY(
        SELECT c.id
        FROM unnest(p_channels) WITH ORDINALITY AS t(name, ord)
        JOIN fairqueue_channel c ON c.name = t.name
        ORDER BY t.ord);
    p_delay := coalesce(p_delay, array_fill(NULL::interval, ARRAY[v_n]));

    -- Every attempt in a block of its own (a subtransaction): see the restart below.
    FOR v_attempt IN 1 .. 20 LOOP
        BEGIN
            WITH input AS (
                SELECT t.ord, v_cids[t.ord] AS cid, t.task, t.payload, t.priority,
                       coalesce(t.run_at, p_now + t.delay, p_now) AS run_at, t.max_attempts,
                       t.keep_result, t.ukey,
                       CASE WHEN t.ukey IS NOT NULL THEN coalesce(t.scope, 'queued') END AS scope
                FROM unnest(p_tasks, p_payloads, p_priorities, p_run_at, p_max_attempts,
                            p_keep_result, p_delay, p_keys, p_scopes)
                     WITH ORDINALITY AS t(task, payload, priority, run_at, max_attempts, keep_result,
                                          delay, ukey, scope, ord)
            ), inserted AS (
                INSERT INTO fairqueue_message AS m (
                    channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
                    max_attempts, keep_result, worker_id, unique_key, unique_scope
                )
                SELECT input.cid, input.task, input.payload, input.priority,
                       CASE WHEN input.run_at > p_now THEN 'scheduled' ELSE 'ready' END,
                       input.run_at, p_now, 0, input.max_attempts, input.keep_result, '', input.ukey,
                       input.scope
                FROM input
                -- not a key a running message of scope 'active' holds (as far as this snapshot
                -- shows: checked again after the insert). A lateral subquery with LIMIT: one
                -- probe of the hold row's key per message, never a join over the whole tables
                -- (which a generic plan's anti-join chose: 20 ms per batch of 100).
                LEFT JOIN LATERAL (
                    SELECT o.id
                    FROM fairqueue_unique_hold h
                    JOIN fairqueue_message o ON o.id = h.message_id
                    WHERE input.ukey IS NOT NULL
                      AND h.channel_id = input.cid AND h.unique_key = input.ukey
                      AND o.channel_id = input.cid AND o.unique_key = input.ukey
                      AND o.unique_scope = 'active'
                      AND o.state IN ('ready', 'scheduled', 'running')
                    LIMIT 1
                ) held ON true
                WHERE held.id IS NULL
                -- Keyed rows in (channel, key) order: two batches inserting the same keys in opposite
                -- orders would each wait for the other's first key (ON CONFLICT waits for an insert
                -- in progress), a deadlock. The rows without a key come first, in input order, so
                -- their ids still follow it.
                ORDER BY input.ukey IS NOT NULL, input.cid, input.ukey, input.ord
                ON CONFLICT (channel_id, unique_key)
                    WHERE unique_key IS NOT NULL AND state IN ('ready', 'scheduled')
                    DO NOTHING
                RETURNING m.id, m.channel_id, m.state, m.unique_key, m.unique_scope
            ), delta AS (
                INSERT INTO fairqueue_channel_delta (
                    channel_id, ready, scheduled, running, failed, succeeded, backlog_check
                )
                SELECT inserted.channel_id,
                       count(*) FILTER (WHERE inserted.state = 'ready'),
                       count(*) FILTER (WHERE inserted.state = 'scheduled'),
                       0, 0, 0,
                       coalesce(inserted.channel_id = ANY (p_bounded), false)
                FROM inserted
                GROUP BY inserted.channel_id
            )
            SELECT array_agg(inserted.id ORDER BY inserted.id) FILTER (WHERE inserted.unique_key IS NULL),
                   array_agg(inserted.id) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   array_agg(inserted.channel_id) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   array_agg(inserted.unique_key) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   array_agg(inserted.unique_scope) FILTER (WHERE inserted.unique_key IS NOT NULL)
            INTO v_plain, v_kid, v_kch, v_kkey, v_kscope
            FROM inserted;

            -- The inserted keys, checked again now that their index entries are in place (a
            -- fresh snapshot: a holder of scope 'active' claimed since the insert's snapshot
            -- is seen now), and the hold rows of those of scope 'active' taken, in (channel,
            -- key) order. At READ COMMITTED one statement each (nobody can start holding an
            -- inserted key before this transaction ends: see fairqueue_unique_holder_v1);
            -- otherwise that function, key by key, with its locks.
            IF v_kid IS NOT NULL THEN
                IF current_setting('transaction_isolation') = 'read committed' THEN
                    IF EXISTS (
                        SELECT FROM unnest(v_kid, v_kch, v_kkey) AS k(id, ch, ukey)
                        CROSS JOIN LATERAL (  -- one probe per key, as above
                            SELECT o.id
                            FROM fairqueue_unique_hold h
                            JOIN fairqueue_message o ON o.id = h.message_id
                            WHERE h.channel_id = k.ch AND h.unique_key = k.ukey
                              AND o.id <> k.id AND o.channel_id = k.ch AND o.unique_key = k.ukey
                              AND o.unique_scope = 'active'
                              AND o.state IN ('ready', 'scheduled', 'running')
                            LIMIT 1
                        ) held)
                    THEN
                        RAISE EXCEPTION USING ERRCODE = 'FQ004';  -- start over: see below
                    END IF;
                    IF 'active' = ANY (v_kscope) THEN
                        INSERT INTO fairqueue_unique_hold AS h (channel_id, unique_key, message_id)
                        SELECT k.ch, k.ukey, k.id
                        FROM unnest(v_kid, v_kch, v_kkey, v_kscope) AS k(id, ch, ukey, scope)
                        WHERE k.scope = 'active'
                        ORDER BY k.ch, k.ukey
                        ON CONFLICT (channel_id, unique_key)
                            DO UPDATE SET message_id = excluded.message_id;
                    END IF;
                ELSIF EXISTS (
                    SELECT FROM unnest(v_kid, v_kch, v_kkey, v_kscope) AS k(id, ch, ukey, scope)
                    WHERE fairqueue_unique_holder_v1(k.ch, k.ukey, k.id, k.scope) IS NOT NULL)
                THEN
                    RAISE EXCEPTION USING ERRCODE = 'FQ004';
                END IF;
            END IF;

            -- Ids by position: messages without a key in input order (the sequence follows it); a
            -- keyed message by its channel and key, only at the first position with that pair (a
            -- later one in the same batch meets the first as the holder, below).
            -- (A hash join, not a look-up per position: that was a scan of the inserted keys for each
            -- message, quadratic in the batch.)
            v_out := ARRAY(
                SELECT CASE
                           WHEN y.ukey IS NULL THEN v_plain[y.rank_plain]
                           WHEN y.rank_keyed = 1 THEN k.id
                       END
                FROM (
                    SELECT t.ord, t.ukey, v_cids[t.ord] AS cid,
                           row_number() OVER (PARTITION BY t.ukey IS NULL, v_cids[t.ord], t.ukey
                                              ORDER BY t.ord) AS rank_keyed,
                           row_number() OVER (PARTITION BY t.ukey IS NULL ORDER BY t.ord) AS rank_plain
                    FROM unnest(p_keys) WITH ORDINALITY AS t(ukey, ord)
                ) y
                LEFT JOIN unnest(v_kid, v_kch, v_kkey) AS k(id, ch, ukey)
                  ON k.ch = y.cid AND k.ukey = y.ukey
                ORDER BY y.ord);

            -- Held keys, in (channel, key) order too: a replace locks the holder it rewrites.
            FOREACH i IN ARRAY ARRAY(
                SELECT t.ord FROM unnest(p_keys) WITH ORDINALITY AS t(ukey, ord)
                WHERE v_out[t.ord] IS NULL
                ORDER BY v_cids[t.ord], t.ukey, t.ord
            ) LOOP
                CONTINUE WHEN v_out[i] IS NOT NULL;
                v_policy := coalesce(p_policies[i], 'keep');
                v_scope := coalesce(p_scopes[i], 'queued');
                v_run_at := coalesce(p_run_at[i], p_now + p_delay[i], p_now);
                v_new_state := CASE WHEN v_run_at > p_now THEN 'scheduled' ELSE 'ready' END;
                v_tries := 0;
                LOOP
                    v_tries := v_tries + 1;
                    IF v_tries > 100 THEN  -- the key kept changing hands: let the caller retry
                        RAISE EXCEPTION 'fairqueue: unique key % of channel % kept changing hands',
                            quote_literal(p_keys[i]), quote_literal(p_channels[i])
                            USING ERRCODE = '40001';
                    END IF;
                    -- the waiting holder (the index), else a running one of scope 'active'
                    SELECT x.id, x.state INTO v_id, v_state
                    FROM (
                        (SELECT m.id, m.state
                         FROM fairqueue_message m
                         WHERE m.channel_id = v_cids[i] AND m.unique_key = p_keys[i]
                           AND m.state IN ('ready', 'scheduled'))
                        UNION ALL
                        (SELECT o.id, o.state
                         FROM fairqueue_unique_hold h
                         JOIN fairqueue_message o ON o.id = h.message_id
                         WHERE h.channel_id = v_cids[i] AND h.unique_key = p_keys[i]
                           AND o.channel_id = v_cids[i] AND o.unique_key = p_keys[i]
                           AND o.unique_scope = 'active' AND o.state = 'running')
                    ) x
                    LIMIT 1;
                    IF FOUND THEN
                        IF v_policy = 'raise' THEN
                            RAISE EXCEPTION 'fairqueue: channel % already has message % (%) with unique key %',
                                quote_literal(p_channels[i]), v_id, v_state, quote_literal(p_keys[i])
                                USING ERRCODE = 'FQ003',
                                      DETAIL = json_build_object(
                                          'channel', p_channels[i], 'unique_key', p_keys[i],
                                          'message_id', v_id, 'state', v_state)::text;
                        END IF;
                        IF v_policy = 'replace' AND v_state <> 'running' THEN
                            -- Lock it, re-checked on its newest version: a claim may be taking it.
                            SELECT m.state INTO v_state
                            FROM fairqueue_message m
                            WHERE m.id = v_id AND m.unique_key = p_keys[i]
                              AND m.state IN ('ready', 'scheduled')
                            FOR UPDATE;
                            CONTINUE WHEN NOT FOUND;  -- it started or went meanwhile: look again
                            UPDATE fairqueue_message m
                            SET task_name = p_tasks[i], payload = p_payloads[i],
                                priority = p_priorities[i], run_at = v_run_at, state = v_new_state,
                                max_attempts = p_max_attempts[i], keep_result = p_keep_result[i],
                                unique_scope = v_scope, attempts = 0
                            WHERE m.id = v_id;
                            IF v_scope = 'active' THEN
                                -- now of scope 'active': it takes the key's hold row (a waiting
                                -- holder is the key's only one: any row there holds nothing)
                                INSERT INTO fairqueue_unique_hold AS h (
                                    channel_id, unique_key, message_id
                                )
                                VALUES (v_cids[i], p_keys[i], v_id)
                                ON CONFLICT (channel_id, unique_key)
                                    DO UPDATE SET message_id = excluded.message_id
                                    WHERE h.message_id <> excluded.message_id;
                            END IF;
                            IF v_state <> v_new_state THEN
                                INSERT INTO fairqueue_channel_delta (
                                    channel_id, ready, scheduled, running, failed, succeeded,
                                    backlog_check
                                )
                                VALUES (v_cids[i],
                                        CASE WHEN v_new_state = 'ready' THEN 1 ELSE -1 END,
                                        CASE WHEN v_new_state = 'ready' THEN -1 ELSE 1 END,
                                        0, 0, 0, false);
                            END IF;
                        END IF;
                        v_out[i] := v_id;
                        EXIT;
                    END IF;
                    -- Nobody holds the key now (its holder started or finished). Inserting it here
                    -- could wait for a concurrent batch's insert of this key while this one holds
                    -- later keys that batch waits for: start over instead, from the first pass (the
                    -- block's rollback gives back every key this call took).
                    RAISE EXCEPTION USING ERRCODE = 'FQ004';
                END LOOP;
            END LOOP;
            RETURN QUERY SELECT x FROM unnest(v_out) AS x;
            RETURN;
        EXCEPTION WHEN SQLSTATE 'FQ004' THEN
            NULL;  -- a key freed meanwhile: everything of this attempt is rolled back
        END;
    END LOOP;
    RAISE EXCEPTION 'fairqueue: unique keys of channel % kept changing hands',
        quote_literal(p_channels[1]) USING ERRCODE = '40001';
END;
$$;


-- Enqueue a batch in one round trip. Arrays are parallel, one element per message; p_delay
-- (optional) gives per-message delays measured on the database clock, p_run_at absolute times.
-- Channels are created on first use with the given defaults, unless p_create is false: then a
-- batch naming a channel that does not exist inserts nothing and returns no rows, and the
-- caller creates the channels in a short transaction of its own and calls again. (Creating a
-- channel inside a long transaction holds its new name until that transaction ends; two
-- transactions creating channels in opposite orders would deadlock.)
-- Bounded channels (max_backlog set) are checked at once against what is committed, and
-- again, exactly, when the transaction commits (fairqueue_backlog_check_v1); a full channel
-- raises SQLSTATE FQ001 and nothing of the batch is stored. The bound needs READ COMMITTED
-- (a REPEATABLE READ snapshot cannot see the enqueues committed meanwhile): at any other
-- isolation level a batch for a bounded channel raises SQLSTATE FQ002.
-- Returns the new message ids in input order.
-- One message per element of p_payloads; every other per-message array may instead have one
-- element, which then holds for every message (a batch of one channel and one task sends its
-- channel, task, priority, ... once instead of once per message).
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
    p_notify_channel text,
    p_delay interval[] DEFAULT NULL,
    p_create boolean DEFAULT true,
    p_unique_keys text[] DEFAULT NULL,
    p_unique_scopes text[] DEFAULT NULL,
    p_on_conflict text[] DEFAULT NULL
)
RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_names text[];
    v_ids bigint[];
    v_bounded bigint[];
    v_want bigint[];
    v_found integer;
    v_n integer := cardinality(p_payloads);
    -- Every column but the payloads has one element (one channel, one task, one priority, one
    -- run time: the usual batch, and any single message) and there are no unique keys: the
    -- insert then reads the payloads alone, the rest as scalars, and resolves the channel once
    -- (no copies of the one-element arrays, no join per message): 12% of a batch of 100's
    -- server time.
    v_uniform boolean := v_n >= 1 AND p_unique_keys IS NULL
        AND cardinality(p_channels) = 1 AND cardinality(p_tasks) = 1
        AND cardinality(p_priorities) = 1 AND cardinality(p_run_at) = 1
        AND cardinality(p_max_attempts) = 1 AND cardinality(p_keep_result) = 1
        AND coalesce(cardinality(p_delay), 1) = 1;
    v_cid bigint;
    v_run_at timestamptz;
BEGIN
    IF v_uniform THEN
        v_names := p_channels;
        v_run_at := coalesce(p_run_at[1], v_now + p_delay[1], v_now);
    ELSIF v_n > 1 THEN  -- one element for all messages: as many copies as there are messages
        IF cardinality(p_channels) = 1 THEN
            v_names := p_channels;
            p_channels := array_fill(p_channels[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_tasks) = 1 THEN
            p_tasks := array_fill(p_tasks[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_priorities) = 1 THEN
            p_priorities := array_fill(p_priorities[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_run_at) = 1 THEN
            p_run_at := array_fill(p_run_at[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_max_attempts) = 1 THEN
            p_max_attempts := array_fill(p_max_attempts[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_keep_result) = 1 THEN
            p_keep_result := array_fill(p_keep_result[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_delay) = 1 THEN
            p_delay := array_fill(p_delay[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_unique_scopes) = 1 THEN
            p_unique_scopes := array_fill(p_unique_scopes[1], ARRAY[v_n]);
        END IF;
        IF cardinality(p_on_conflict) = 1 THEN
            p_on_conflict := array_fill(p_on_conflict[1], ARRAY[v_n]);
        END IF;
    END IF;
    IF v_names IS NULL THEN
        SELECT array_agg(x.n ORDER BY x.n) INTO v_names
        FROM (SELECT DISTINCT n FROM unnest(p_channels) AS n) x;
    END IF;
    -- Hold the names against deletion (see fairqueue_channel_lock_key_v1) before resolving
    -- them, so the statements below see any deletion that committed first.
    PERFORM pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), hashtext(n))
    FROM unnest(v_names) AS n;

    -- (v_cid: the channel of a uniform batch, which has one)
    SELECT count(*), array_agg(c.id ORDER BY c.id) FILTER (WHERE c.max_backlog IS NOT NULL),
           min(c.id)
    INTO v_found, v_bounded, v_cid
    FROM fairqueue_channel c WHERE c.name = ANY (v_names);
    IF v_found < cardinality(v_names) THEN
        -- (Not at REPEATABLE READ or SERIALIZABLE: this transaction's snapshot would not see
        -- channels committed apart, so it creates them itself.)
        IF NOT p_create AND current_setting('transaction_isolation') = 'read committed' THEN
            RETURN;  -- the caller creates them in a transaction of its own, then calls again
        END IF;
        -- A new statement sees rows committed by concurrent creators, which ON CONFLICT DO
        -- NOTHING waited for; names are inserted in order, so single-statement creators
        -- cannot deadlock.
        INSERT INTO fairqueue_channel AS c (
            name, max_concurrency, release_interval, weight, paused, max_backlog, created_at,
            next_turn_at
        )
        SELECT n, p_default_max_concurrency, p_default_release_interval, p_default_weight,
               false, p_default_max_backlog, v_now, v_now
        FROM unnest(v_names) AS n
        ORDER BY n
        ON CONFLICT (name) DO NOTHING;
        SELECT array_agg(c.id ORDER BY c.id) FILTER (WHERE c.max_backlog IS NOT NULL),
               min(c.id)
        INTO v_bounded, v_cid
        FROM fairqueue_channel c WHERE c.name = ANY (v_names);
    END IF;

    IF v_bounded IS NOT NULL THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'fairqueue: a channel with max_backlog accepts messages only in '
                            'READ COMMITTED transactions; this one is %',
                            upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'FQ002',
                      HINT = 'Enqueue outside the REPEATABLE READ / SERIALIZABLE transaction, '
                             'or clear the channel''s max_backlog.';
        END IF;
        IF v_uniform THEN  -- (p_channels has its one element: all messages are its)
            v_want := ARRAY[v_n];
        ELSE
            SELECT array_agg(coalesce(w.n, 0) ORDER BY b.id) INTO v_want
            FROM unnest(v_bounded) AS b(id)
            JOIN fairqueue_channel c ON c.id = b.id
            LEFT JOIN (SELECT n AS name, count(*) AS n FROM unnest(p_channels) AS n GROUP BY n) w
              ON w.name = c.name;
        END IF;
        -- At once, lock-free: a channel already full refuses without waiting for the commit.
        PERFORM fairqueue_check_backlog_v1(v_bounded, v_want, false);
        PERFORM set_config(
            'fairqueue.bounded',
            concat_ws(',', nullif(current_setting('fairqueue.bounded', true), ''),
                      (SELECT string_agg(x.id || ':' || x.n, ',')
                       FROM unnest(v_bounded, v_want) AS x(id, n))),
            true);
    END IF;

    IF v_uniform THEN
        -- (The name is held, so the channel found above stays. None found, as the join of
        -- the general path below, stores nothing.)
        RETURN QUERY
        WITH inserted AS (
            INSERT INTO fairqueue_message (
                channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
                max_attempts, keep_result, worker_id
            )
            SELECT v_cid, p_tasks[1], t.payload, p_priorities[1],
                   CASE WHEN v_run_at > v_now THEN 'scheduled' ELSE 'ready' END,
                   v_run_at, v_now, 0, p_max_attempts[1], p_keep_result[1], ''
            FROM unnest(p_payloads) WITH ORDINALITY AS t(payload, ord)
            WHERE v_cid IS NOT NULL
            ORDER BY t.ord
            RETURNING fairqueue_message.id
        ), delta AS (
            INSERT INTO fairqueue_channel_delta (
                channel_id, ready, scheduled, running, failed, succeeded, backlog_check
            )
            SELECT v_cid,
                   CASE WHEN v_run_at > v_now THEN 0 ELSE count(*) END,
                   CASE WHEN v_run_at > v_now THEN count(*) ELSE 0 END,
                   0, 0, 0, v_bounded IS NOT NULL
            FROM inserted
            HAVING count(*) > 0
        )
        SELECT inserted.id FROM inserted ORDER BY inserted.id;
    ELSIF p_unique_keys IS NOT NULL THEN
        -- Unique jobs: their own path, so a batch without keys pays nothing for them.
        RETURN QUERY SELECT u.id FROM fairqueue_enqueue_unique_v1(
            p_channels, p_tasks, p_payloads, p_priorities, p_run_at, p_max_attempts,
            p_keep_result, p_delay, p_unique_keys, p_unique_scopes, p_on_conflict, v_now,
            v_bounded) AS u(id);
    ELSE
    RETURN QUERY
    WITH input AS (
        SELECT t.ord, c.id AS cid, c.max_backlog IS NOT NULL AS bounded, t.task, t.payload,
               t.priority,
               coalesce(t.run_at, v_now + t.delay, v_now) AS run_at, t.max_attempts,
               t.keep_result
        FROM unnest(p_channels, p_tasks, p_payloads, p_priorities, p_run_at, p_max_attempts,
                    p_keep_result, coalesce(p_delay, array_fill(NULL::interval,
                                                                 ARRAY[cardinality(p_channels)])))
             WITH ORDINALITY AS t(channel, task, payload, priority, run_at, max_attempts,
                                  keep_result, delay, ord)
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
        INSERT INTO fairqueue_channel_delta (
            channel_id, ready, scheduled, running, failed, succeeded, backlog_check
        )
        SELECT inserted.channel_id,
               count(*) FILTER (WHERE inserted.state = 'ready'),
               count(*) FILTER (WHERE inserted.state = 'scheduled'),
               0, 0, 0,
               coalesce(inserted.channel_id = ANY (v_bounded), false)
        FROM inserted
        GROUP BY inserted.channel_id
        RETURNING 1
    )
    -- ids come from the sequence in insertion order, which follows `ord`
    -- (`delta` is not read: PostgreSQL runs every data-modifying CTE to completion.)
    SELECT inserted.id FROM inserted ORDER BY inserted.id;
    END IF;

    -- One wake-up per transaction at most: PostgreSQL folds identical notifications of a
    -- transaction into one, so a batch (or a view enqueueing many times) notifies once.
    -- And only when an idle worker may be waiting, which it is not (the notification would
    -- only cost: NOTIFY serialises commits on a cluster-wide lock and wakes every listener)
    -- when the batch has one channel and
    -- * a claim left that channel backlogged: its counted ready_count (on the channel row,
    --   which costs nothing more to read) is above zero. A claim leaves ready messages behind
    --   only when the channel is capped, paused or rate limited, or when its claimer had its
    --   fill, and that claimer claims again as it settles. A worker that went idle before that
    --   claim was woken by the enqueues since, which found the count at zero; one that went
    --   idle after it would have taken the rest. This is the common case under load, and it
    --   reads no message: the head of a busy channel's ready index is where claims leave dead
    --   entries until vacuum, and walking them cost the probe below up to 0.2 ms;
    -- * or, with ready_count at zero (no claim has counted this backlog yet), the channel's
    --   head became ready over 50 ms ago. Nobody idle took it (workers are busy, or the
    --   channel is capped, paused or rate limited), and busy workers claim again as they
    --   settle. A fresher head may be being claimed right now by a claim that cannot see this
    --   batch yet: that still notifies. "Became ready" is the later of enqueued_at and run_at:
    --   a message enqueued just now with a run_after already past is a fresh head. The head is
    --   read like the claim reads it (ORDER BY and LIMIT 1 on fq_message_ready_idx): one
    --   index probe, made only when the count is zero (CASE evaluates it lazily).
    -- Batches of several channels (rare, and notifying once for many messages) always notify:
    -- with the names as an array the planner cannot settle on a generic plan and re-plans on
    -- every call.
    IF p_notify_channel IS NOT NULL AND (
        cardinality(v_names) > 1
        OR NOT EXISTS (
            SELECT 1
            FROM fairqueue_channel c
            WHERE c.name = v_names[1]
              AND CASE WHEN c.ready_count > 0 THEN true ELSE EXISTS (
                  SELECT FROM (
                      SELECT m.run_at, m.enqueued_at
                      FROM fairqueue_message m
                      WHERE m.channel_id = c.id AND m.state = 'ready'
                      ORDER BY m.priority DESC, m.id
                      LIMIT 1
                  ) head
                  WHERE greatest(head.run_at, head.enqueued_at)
                        < v_now - interval '50 milliseconds'
              ) END
        )
    ) THEN
        PERFORM pg_notify(p_notify_channel, '');
    END IF;
END;
$$;


-- Enqueue one message: what fairqueue_enqueue_v1 does for a batch of one, in fewer statements
-- (a view's enqueue() is the call made most). Scalar arguments, as fairqueue_enqueue_v1's
-- arrays' elements. An existing channel without max_backlog takes the fast path: the name
-- lock (the same shared lock, taken first, in a statement of its own, so the next statement's
-- snapshot sees any deletion that committed before it), then one statement that resolves the
-- name, makes the wake-up decision and inserts the message and its delta. A missing or bounded
-- channel goes through fairqueue_enqueue_v1 (channel creation, the at-once and at-commit
-- bounds); returns NULL where it returns no rows (p_create false).
-- The wake-up decision is fairqueue_enqueue_v1's: no NOTIFY when a claim left the channel
-- backlogged (ready_count above zero). Otherwise the head is read before the insert, in the
-- same statement: the message does not notify when that head became ready over 50 ms ago and
-- still comes first after the insert (same or higher priority, or this message is
-- scheduled), exactly when fairqueue_enqueue_v1's probe after the insert would find that
-- stale head.
CREATE OR REPLACE FUNCTION fairqueue_enqueue_one_v1(
    p_channel text,
    p_task text,
    p_payload jsonb,
    p_priority smallint,
    p_run_at timestamptz,
    p_max_attempts integer,
    p_keep_result boolean,
    p_default_max_concurrency integer,
    p_default_release_interval interval,
    p_default_weight integer,
    p_default_max_backlog integer,
    p_notify_channel text,
    p_delay interval DEFAULT NULL,
    p_create boolean DEFAULT true,
    p_unique_key text DEFAULT NULL,
    p_unique_scope text DEFAULT NULL,
    p_on_conflict text DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_run_at timestamptz := coalesce(p_run_at, v_now + p_delay, v_now);
    v_key integer := hashtext(p_channel);
    v_id bigint;
    v_cid bigint;
    v_quiet boolean;
BEGIN
    IF p_unique_key IS NOT NULL THEN
        -- A unique job. The common case, an existing channel without max_backlog and a key
        -- nobody holds, is one statement like the plain one below (the same name lock first),
        -- its insert arbitrated by fq_message_unique_idx, then the check of a running holder
        -- of scope 'active' (fairqueue_unique_holder_v1, which also takes the key's hold row
        -- for a message of that scope). Anything else (a missing or bounded channel, a held
        -- key and its policy) goes through fairqueue_enqueue_unique_v1's rules.
        IF NOT pg_try_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), v_key) THEN
            PERFORM pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), v_key);
        END IF;
        WITH ch AS (
            SELECT c.id
            FROM fairqueue_channel c
            WHERE c.name = p_channel AND c.max_backlog IS NULL
        ), inserted AS (
            INSERT INTO fairqueue_message AS m (
                channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
                max_attempts, keep_result, worker_id, unique_key, unique_scope
            )
            SELECT ch.id, p_task, p_payload, p_priority,
                   CASE WHEN v_run_at > v_now THEN 'scheduled' ELSE 'ready' END,
                   v_run_at, v_now, 0, p_max_attempts, p_keep_result, '', p_unique_key,
                   coalesce(p_unique_scope, 'queued')
            FROM ch
            -- not a key a running message of scope 'active' holds, as far as this snapshot
            -- shows (checked again below; one probe, as in fairqueue_enqueue_unique_v1)
            LEFT JOIN LATERAL (
                SELECT o.id
                FROM fairqueue_unique_hold h
                JOIN fairqueue_message o ON o.id = h.message_id
                WHERE h.channel_id = ch.id AND h.unique_key = p_unique_key
                  AND o.channel_id = ch.id AND o.unique_key = p_unique_key
                  AND o.unique_scope = 'active' AND o.state IN ('ready', 'scheduled', 'running')
                LIMIT 1
            ) held ON true
            WHERE held.id IS NULL
            ON CONFLICT (channel_id, unique_key)
                WHERE unique_key IS NOT NULL AND state IN ('ready', 'scheduled')
                DO NOTHING
            RETURNING m.id, m.channel_id
        ), delta AS (
            INSERT INTO fairqueue_channel_delta (
                channel_id, ready, scheduled, running, failed, succeeded, backlog_check
            )
            SELECT inserted.channel_id, (v_run_at <= v_now)::integer,
                   (v_run_at > v_now)::integer, 0, 0, 0, false
            FROM inserted
        )
        SELECT inserted.id, inserted.channel_id INTO v_id, v_cid FROM inserted;
        IF v_id IS NOT NULL
           AND fairqueue_unique_holder_v1(v_cid, p_unique_key, v_id,
                                          coalesce(p_unique_scope, 'queued')) IS NOT NULL
        THEN
            -- A running holder of scope 'active', claimed after this statement's snapshot
            -- was taken: take the message back out and let the general path apply the policy.
            DELETE FROM fairqueue_message m WHERE m.id = v_id;
            INSERT INTO fairqueue_channel_delta (
                channel_id, ready, scheduled, running, failed, succeeded, backlog_check, wake
            )
            VALUES (v_cid, -(v_run_at <= v_now)::integer, -(v_run_at > v_now)::integer,
                    0, 0, 0, false, false);
            v_id := NULL;
        END IF;
        IF v_id IS NOT NULL THEN
            -- (without the plain path's test of a stale head: a unique job always wakes)
            IF p_notify_channel IS NOT NULL THEN
                PERFORM pg_notify(p_notify_channel, '');
            END IF;
            RETURN v_id;
        END IF;
        SELECT e.id INTO v_id
        FROM fairqueue_enqueue_v1(
            ARRAY[p_channel], ARRAY[p_task], ARRAY[p_payload], ARRAY[p_priority],
            ARRAY[p_run_at], ARRAY[p_max_attempts], ARRAY[p_keep_result],
            p_default_max_concurrency, p_default_release_interval, p_default_weight,
            p_default_max_backlog, p_notify_channel, ARRAY[p_delay], p_create,
            ARRAY[p_unique_key], ARRAY[p_unique_scope], ARRAY[p_on_conflict]) AS e(id);
        RETURN v_id;
    END IF;
    -- (An expression, not PERFORM: PL/pgSQL evaluates it without starting an executor. The
    -- lock is the one fairqueue_enqueue_v1 takes; it waits only while a deletion holds it.)
    IF NOT pg_try_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), v_key) THEN
        PERFORM pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), v_key);
    END IF;
    WITH ch AS (
        SELECT c.id, c.ready_count
        FROM fairqueue_channel c
        WHERE c.name = p_channel AND c.max_backlog IS NULL
    ), head AS (
        SELECT m.priority, greatest(m.run_at, m.enqueued_at) AS since
        FROM fairqueue_message m
        WHERE m.channel_id = (SELECT ch.id FROM ch) AND m.state = 'ready'
        ORDER BY m.priority DESC, m.id
        LIMIT 1
    ), inserted AS (
        INSERT INTO fairqueue_message (
            channel_id, task_name, payload, priority, state, run_at, enqueued_at, attempts,
            max_attempts, keep_result, worker_id
        )
        SELECT ch.id, p_task, p_payload, p_priority,
               CASE WHEN v_run_at > v_now THEN 'scheduled' ELSE 'ready' END,
               v_run_at, v_now, 0, p_max_attempts, p_keep_result, ''
        FROM ch
        RETURNING fairqueue_message.id, fairqueue_message.channel_id
    ), delta AS (
        INSERT INTO fairqueue_channel_delta (
            channel_id, ready, scheduled, running, failed, succeeded, backlog_check
        )
        SELECT inserted.channel_id, (v_run_at <= v_now)::integer, (v_run_at > v_now)::integer,
               0, 0, 0, false
        FROM inserted
    )
    SELECT inserted.id,
           CASE WHEN (SELECT ch.ready_count FROM ch) > 0 THEN true
                ELSE EXISTS (SELECT FROM head
                             WHERE head.since < v_now - interval '50 milliseconds'
                               AND (head.priority >= p_priority OR v_run_at > v_now))
           END
    INTO v_id, v_quiet
    FROM inserted;
    IF v_id IS NULL THEN  -- a missing or bounded channel: nothing was inserted
        SELECT e.id INTO v_id
        FROM fairqueue_enqueue_v1(
            ARRAY[p_channel], ARRAY[p_task], ARRAY[p_payload], ARRAY[p_priority],
            ARRAY[p_run_at], ARRAY[p_max_attempts], ARRAY[p_keep_result],
            p_default_max_concurrency, p_default_release_interval, p_default_weight,
            p_default_max_backlog, p_notify_channel, ARRAY[p_delay], p_create) AS e(id);
        RETURN v_id;
    END IF;
    IF p_notify_channel IS NOT NULL AND NOT v_quiet THEN
        PERFORM pg_notify(p_notify_channel, '');
    END IF;
    RETURN v_id;
END;
$$;


-- The bounded-backlog check at commit, on the delta rows an enqueue to a bounded channel writes.
DROP TRIGGER IF EXISTS fairqueue_backlog_check ON fairqueue_channel_delta;
CREATE CONSTRAINT TRIGGER fairqueue_backlog_check
    AFTER INSERT ON fairqueue_channel_delta
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.backlog_check)
    EXECUTE FUNCTION fairqueue_backlog_check_v1();


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
    v_n integer;
    v_vnow double precision;
    v_group bigint;
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
    ), sums AS (
        SELECT coalesce(sum(ready), 0) AS ready, coalesce(sum(scheduled), 0) AS scheduled,
               coalesce(sum(running), 0) AS running, coalesce(sum(failed), 0) AS failed,
               coalesce(sum(succeeded), 0) AS succeeded,
               coalesce(bool_or(batch_pending), false) AS batches,
               coalesce(sum(run_seconds), 0) AS run, coalesce(sum(run_count), 0) AS runs,
               coalesce(sum(run_count) FILTER (WHERE run_seconds > 0), 0) AS ran,
               count(*) AS n
        FROM gone
    )
    UPDATE fairqueue_channel c
    SET ready_count = c.ready_count + sums.ready,
        scheduled_count = c.scheduled_count + sums.scheduled,
        running_count = c.running_count + sums.running,
        failed_count = c.failed_count + sums.failed,
        succeeded_total = c.succeeded_total + sums.succeeded,
        batch_pending = c.batch_pending OR sums.batches,
        next_turn_at = CASE  -- as in fairqueue_fold_deltas_v1
            WHEN c.release_interval = interval '0' AND c.next_turn_at > statement_timestamp()
                THEN statement_timestamp()
            ELSE c.next_turn_at
        END,
        -- lifted, and at most one message's charge ahead (as fairqueue_lift_v1)
        vtime = fairqueue_lift_v1(
            c.vtime + (sums.run - sums.runs * coalesce(c.mean_run, fairqueue_default_run_v1()))
                      / c.weight,
            v_vnow, false, true,
            fairqueue_charge_v1(fairqueue_mean_run_v1(c.mean_run, sums.run, sums.ran), c.weight)),
        mean_run = fairqueue_mean_run_v1(c.mean_run, sums.run, sums.ran)
    FROM sums
    WHERE c.id = p_channel_id
    RETURNING sums.n INTO v_n;
    RETURN coalesce(v_n, 0);
END;
$$;


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
-- its delta (not deleted) keeps the counter exact when the fold adds it later.
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
            RETURNING d.succeeded, d.batch_pending
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
