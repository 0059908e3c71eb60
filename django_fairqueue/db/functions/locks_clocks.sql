-- django-fairqueue server functions: locks and clocks. The lock order every function follows,
-- the advisory-lock namespaces, and the virtual clocks of fairness by time (the system and
-- group virtual times, a channel's lift, charge and mean run time).

-- Lock order (docs/explanation/fairness.md, "Lock order"); every statement follows it:
--   1. advisory locks on channel names, shared (enqueue) or exclusive (deleting a channel);
--   2. fairqueue_channel rows, in id order. Claims (messages and work batches), the fold and
--      the repair write counters and turns; operators write only configuration columns (the
--      Django model maps no other). Claims and the fold never wait for a channel row: they
--      use SKIP LOCKED (a claim's bounded CLAIM_WAIT ends in lock_timeout, not a deadlock);
--   3. fairqueue_channel_group rows: the group of a channel, after the channel, by whoever
--      writes a grouped channel's counters (fairqueue_group_counters_v1) and by the folds,
--      which correct its tag (fairqueue_correct_groups_v1); claims lock a group SKIP LOCKED
--      (or under CLAIM_WAIT's lock_timeout) and its channels SKIP LOCKED, and charge both in
--      one statement at the end (fairqueue_claim_v1);
--   4. fairqueue_channel_delta rows: inserted by every writer of messages, deleted by the fold
--      and the repair, which lock them SKIP LOCKED or after the channel (the repair inserts
--      back what they recorded of run time);
--   5. fairqueue_message and fairqueue_work_batch rows, in id order within one statement.
--      Claims lock ready rows SKIP LOCKED (they never wait on a message), settlements only
--      rows their lease token owns;
--   6. the bounded-backlog advisory locks, taken only while the transaction commits, all at
--      once in channel id order (fairqueue_backlog_check_v1).
-- Nothing takes a lock of an earlier rank while it waits for a later one, except a caller's
-- own transaction doing so across statements, which the SKIP LOCKED waits above tolerate.


-- Commits without the WAL flush. The worker's own claims and completions (each a transaction
-- of its own) commit with synchronous_commit = off: the commit returns before its WAL reaches
-- the disk (or a synchronous standby), which on most disks is most of a small transaction's
-- time. A database crash can lose the last moments of them (at most about three times
-- wal_writer_delay), as if their worker had crashed then: a lost claim never happened, so its
-- messages run again (at-least-once delivery allows it); a lost completion leaves its message
-- running until its lease expires, then retried or, out of attempts, dead-lettered. Anything
-- committed durably later (an enqueue, say) flushes them too, so nothing that depends on them
-- survives without them. A claim of an at-most-once message stays durable
-- (fairqueue_hold_commit_v1, from the claim's RETURNING list): lost, it would run twice.
-- Transaction-local settings only, so nothing outlives the transaction (or leaks to another
-- client through a pooler). fairqueue.commit_was keeps the setting from before, for the hold.
CREATE OR REPLACE FUNCTION fairqueue_relax_commit_v1() RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('fairqueue.commit_held', true) IS DISTINCT FROM 'on' THEN
        IF coalesce(current_setting('fairqueue.commit_was', true), '') = '' THEN
            PERFORM set_config('fairqueue.commit_was', current_setting('synchronous_commit'), true);
        END IF;
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION fairqueue_hold_commit_v1() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('fairqueue.commit_held', 'on', true);
    IF coalesce(current_setting('fairqueue.commit_was', true), '') <> '' THEN
        PERFORM set_config('synchronous_commit', current_setting('fairqueue.commit_was'), true);
    END IF;
    RETURN true;
END;
$$;


-- Advisory-lock namespace of the bounded-backlog check at commit: ("fq" as int, the stripe of
-- the channel id).
CREATE OR REPLACE FUNCTION fairqueue_lock_key_v1() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 26225 $$;


-- Channel existence: every enqueue holds a shared lock per channel name (in this namespace,
-- keyed by hashtext(name)) until its transaction ends, and deleting a channel takes the
-- exclusive one first. A deletion therefore waits for enqueues in flight (and then deletes
-- their messages too), and an enqueue that comes after it finds the name gone and creates the
-- channel anew: no message is ever left behind with a channel id that no longer exists.
-- Shared locks never conflict with each other, so enqueues cannot deadlock on them.
-- A batch of more than 128 names holds their stripes instead (below): at most 128 locks.
CREATE OR REPLACE FUNCTION fairqueue_channel_lock_key_v1() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 26227 $$;


-- Lock stripes: a key's stripe, one of 128. PostgreSQL's lock table is one pool for every
-- session (max_locks_per_transaction x max_connections entries, 6,400 by default): a batch
-- that held one advisory lock per channel filled it with a few thousand channels, and every
-- session's next lock (another tenant's enqueue) then failed with "out of shared memory".
-- A transaction takes at most 128 stripe locks per namespace, whatever its batches hold.
CREATE OR REPLACE FUNCTION fairqueue_lock_stripe_v1(p_key bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT (p_key & 127)::integer $$;


-- Channel-name stripes (key fairqueue_lock_stripe_v1(hashtext(name))): held, shared, by an
-- enqueue of more than 128 names in place of the names' own locks. Deleting a channel takes
-- its name's lock and then its stripe's, so it waits for either kind of enqueue; a deletion
-- never blocks enqueues of other channels that take the names' own locks, as most do.
CREATE OR REPLACE FUNCTION fairqueue_channel_stripe_key_v1() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 26228 $$;


-- Fairness by time (FAIRQUEUE['FAIRNESS'] = 'time'; docs/explanation/fairness.md, "Fairness by
-- time"). Each channel carries `vtime`, its virtual start tag: the seconds of worker time it
-- was charged, divided by its weight. The claim serves the claimable channel with the smallest
-- tag (index fq_channel_vtime_idx) and charges it the channel's mean run time per message
-- (`mean_run`, FAIRQUEUE_DEFAULT_RUN when unknown); the settlement's delta carries the time
-- the messages really ran, and the fold puts the difference right. A channel that becomes
-- claimable (new work after being idle, a freed slot, unpaused, its first run time known) is
-- lifted to its queue's virtual time, so it cannot bank credit while it was away.

-- The estimate charged per message of a channel with no recorded run time yet (seconds).
CREATE OR REPLACE FUNCTION fairqueue_default_run_v1() RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 0.01::double precision $$;


-- The virtual time of queue p_queue, other than channel p_exclude and group p_exclude_group:
-- the smallest tag of a top-level flow the claim can serve as soon as its turn comes, an
-- ungrouped channel (fq_channel_vtime_idx, its predicate repeated word for word) or a channel
-- group (fq_group_vtime_idx). Tags are compared only within a queue (each claim serves one),
-- so a queue served by fewer workers, or by none, never holds another's virtual time back.
-- Left out, because their tags stay low for reasons that are not banked service, and a
-- channel lifted to them would come back far ahead of the backlogged ones: a rate-limited
-- flow (it takes one message an interval, whatever its tag), and a channel in slow start
-- (no run time known yet and one message running: the claim takes no more of it until that
-- one settles). Only the first 32 entries of each index are read: when none of them is such a
-- flow's, the largest tag below stands in (a channel lifted there starts behind the backlogged
-- flows, never ahead of them). NULL (lift nobody) when every claimable flow is left out: no
-- flow is served now that a lifted one could overtake. When no flow of the queue is
-- claimable, the largest tag of any flow (fq_channel_vtime_max_idx, fq_group_vtime_max_idx):
-- after the queue went idle every flow starts level with the most served one, so a channel
-- that was idle longest cannot come back ahead of one that ran recently. Index probes, no lock.
-- (Those indexes hold only tags above 0: by count no tag moves, so claims and folds by count
-- add nothing to them; a largest tag of 0 is the same as none.)
-- Channels of a group have tags of their own, compared only within their group
-- (fairqueue_group_virtual_time_v1).
CREATE OR REPLACE FUNCTION fairqueue_queue_virtual_time_v1(
    p_queue text, p_exclude bigint, p_exclude_group bigint
)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    -- (Each part reads its index only as far as its first such flow: the outer LIMIT 1 takes
    -- the inner rows in their index order, as they come.)
    SELECT CASE
        WHEN least(x.c, x.g) IS NOT NULL THEN least(x.c, x.g)
        WHEN EXISTS (SELECT FROM fairqueue_channel c
                     WHERE c.claimable
                       AND c.group_id IS NULL
                       AND c.queue = p_queue
                       AND c.id IS DISTINCT FROM p_exclude)
          OR EXISTS (SELECT FROM fairqueue_channel_group g
                     WHERE g.claimable > 0
                       AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
                       AND g.queue = p_queue
                       AND g.id IS DISTINCT FROM p_exclude_group)
            THEN NULL
        ELSE coalesce(nullif(greatest(
            (SELECT max(c.vtime) FROM fairqueue_channel c
             WHERE c.vtime > 0 AND c.group_id IS NULL AND c.id IS DISTINCT FROM p_exclude),
            (SELECT max(g.vtime) FROM fairqueue_channel_group g
             WHERE g.vtime > 0 AND g.id IS DISTINCT FROM p_exclude_group)), 0), 0)
    END
    FROM (SELECT
        (SELECT w.vtime FROM (
            SELECT c.vtime, c.id, c.release_interval = interval '0'
                                  AND (c.mean_run IS NOT NULL OR c.running_count = 0) AS eligible,
                   row_number() OVER (ORDER BY c.vtime, c.id) AS n
            FROM fairqueue_channel c
            WHERE c.claimable
              AND c.group_id IS NULL
              AND c.queue = p_queue
              AND c.id IS DISTINCT FROM p_exclude
            ORDER BY c.vtime, c.id
            LIMIT 32) w
         WHERE w.eligible OR w.n = 32
         ORDER BY w.vtime, w.id
         LIMIT 1) AS c,
        (SELECT w.vtime FROM (
            SELECT g.vtime, g.id, g.release_interval = interval '0' AS eligible,
                   row_number() OVER (ORDER BY g.vtime, g.id) AS n
            FROM fairqueue_channel_group g
            WHERE g.claimable > 0
              AND (g.max_concurrency IS NULL OR g.running_count < g.max_concurrency)
              AND g.queue = p_queue
              AND g.id IS DISTINCT FROM p_exclude_group
            ORDER BY g.vtime, g.id
            LIMIT 32) w
         WHERE w.eligible OR w.n = 32
         ORDER BY w.vtime, w.id
         LIMIT 1) AS g
        OFFSET 0  -- (computed once: the CASE reads them twice)
    ) x
$$;


-- The virtual time inside group p_group, other than channel p_exclude: the smallest tag of a
-- claimable channel of the group the claim can serve as soon as its turn comes (not rate
-- limited, not in slow start: as fairqueue_queue_virtual_time_v1, the first 32 entries of
-- fq_channel_in_group_vtime_idx; NULL when every claimable one is left out), else the largest
-- tag of any of its channels (fq_channel_group_idx). Index probes, no lock.
CREATE OR REPLACE FUNCTION fairqueue_group_virtual_time_v1(p_group bigint, p_exclude bigint)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN x.v IS NOT NULL THEN x.v
        WHEN EXISTS (SELECT FROM fairqueue_channel c
                     WHERE c.group_id IS NOT NULL
                       AND c.claimable
                       AND c.group_id = p_group
                       AND c.id IS DISTINCT FROM p_exclude)
            THEN NULL
        ELSE coalesce((SELECT c.vtime FROM fairqueue_channel c
                       WHERE c.group_id IS NOT NULL AND c.group_id = p_group
                         AND c.id IS DISTINCT FROM p_exclude
                       ORDER BY c.vtime DESC
                       LIMIT 1), 0)
    END
    FROM (SELECT
        (SELECT w.vtime FROM (
            SELECT c.vtime, c.id, c.release_interval = interval '0'
                                  AND (c.mean_run IS NOT NULL OR c.running_count = 0) AS eligible,
                   row_number() OVER (ORDER BY c.vtime, c.id) AS n
            FROM fairqueue_channel c
            WHERE c.group_id IS NOT NULL
              AND c.claimable
              AND c.group_id = p_group
              AND c.id IS DISTINCT FROM p_exclude
            ORDER BY c.vtime, c.id
            LIMIT 32) w
         WHERE w.eligible OR w.n = 32
         ORDER BY w.vtime, w.id
         LIMIT 1) AS v
        OFFSET 0  -- (computed once: the CASE reads it twice)
    ) x
$$;


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


-- A group's turn once it is woken (one of its channels made claimable, or its rate limit
-- eased): no later than it was, and no earlier than now or its rate limit's next release. The
-- counter trigger, the folds and the release-interval trigger set it so; the next-due question
-- and the why-waiting reads compute it the same way for a group not woken yet.
CREATE OR REPLACE FUNCTION fairqueue_woken_turn_v1(
    p_turn timestamptz, p_last_claimed timestamptz, p_interval interval, p_now timestamptz
)
RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT least(p_turn, greatest(p_now, coalesce(p_last_claimed + p_interval,
                                                   '-infinity'::timestamptz)))
$$;
