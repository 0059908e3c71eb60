-- django-fairqueue server functions: channel groups. The triggers that keep a channel row in
-- the group its name declares and its name unchanged, the creation of missing groups, the
-- trigger that keeps a group's counters the sums of its channels', and the lift of a group
-- whose limits an operator eased.

-- Channel groups (docs/explanation/fairness.md, "Groups of channels"). A channel may belong to
-- a group (fairqueue_channel.group_id); the claim is fair across the top-level flows first
-- (groups, and ungrouped channels, each of which is a flow of its own), then across the
-- channels of a group. A group row carries the operator's weight, cap and rate limit and the
-- group's scheduler state, which only the functions below write: ready_count, running_count
-- (the sums of its channels' columns), claimable (how many of its channels are claimable by
-- their counters), next_turn_at, turn_used, vtime, last_claimed_at.


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
DECLARE
    v_ids bigint[];
BEGIN
    WITH attached AS (
        UPDATE fairqueue_channel c
        SET group_id = NEW.id
        WHERE c.group_id IS NULL AND fairqueue_group_of_name_v1(c.name) = NEW.name
        RETURNING c.id
    )
    SELECT array_agg(attached.id) INTO v_ids FROM attached;
    -- Their quiet enqueue deltas, counted now: a group's claims do not count them before they
    -- take all a channel counts, as an ungrouped channel's do (fairqueue_delta_wakes_v1).
    -- (One still in flight is counted by the maintenance loop's fold.)
    PERFORM fairqueue_count_quiet_v1(v_ids, false);
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
    IF TG_OP = 'UPDATE'
       AND (OLD.ready_count, OLD.running_count, OLD.paused, OLD.max_concurrency, OLD.group_id)
           IS NOT DISTINCT FROM (NEW.ready_count, NEW.running_count, NEW.paused,
                                 NEW.max_concurrency, NEW.group_id) THEN
        RETURN NULL;  -- nothing the group's sums follow changed: its row is not touched
    END IF;
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
            next_turn_at = CASE WHEN v_new AND NOT v_old
                THEN fairqueue_woken_turn_v1(g.next_turn_at, g.last_claimed_at,
                                             g.release_interval, statement_timestamp())
                ELSE g.next_turn_at END,
            vtime = CASE WHEN v_new AND NOT v_old AND g.claimable = 0
                THEN fairqueue_lift_v1(g.vtime, fairqueue_queue_virtual_time_v1(g.queue::text, NULL, g.id), false,
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
            next_turn_at = CASE WHEN v_new
                THEN fairqueue_woken_turn_v1(g.next_turn_at, g.last_claimed_at,
                                             g.release_interval, statement_timestamp())
                ELSE g.next_turn_at END,
            vtime = CASE WHEN v_new AND g.claimable = 0
                THEN fairqueue_lift_v1(g.vtime, fairqueue_queue_virtual_time_v1(g.queue::text, NULL, g.id), false,
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
    -- Grouped channels only. The WHEN clause is parsed again by every statement that updates
    -- these columns (each claim's charge and each fold), so it stays this short: whether
    -- anything changed is the function's first test.
    WHEN (OLD.group_id IS NOT NULL OR NEW.group_id IS NOT NULL)
    EXECUTE FUNCTION fairqueue_group_counters_v1();

DROP TRIGGER IF EXISTS fairqueue_group_counters_delete ON fairqueue_channel;
CREATE TRIGGER fairqueue_group_counters_delete
    AFTER DELETE ON fairqueue_channel
    FOR EACH ROW
    WHEN (OLD.group_id IS NOT NULL)
    EXECUTE FUNCTION fairqueue_group_counters_v1();


-- A rate limit removed or shortened takes effect at once, however the row is written (the
-- admin, the ORM's save() or update(), SQL): a channel or group waiting for its next release
-- is due when the new interval says, counted from its last release, and never later than it
-- was. Only an update that names release_interval fires it: a claim's or a fold's does not.
CREATE OR REPLACE FUNCTION fairqueue_rearm_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.next_turn_at := fairqueue_woken_turn_v1(NEW.next_turn_at, NEW.last_claimed_at,
                                                NEW.release_interval, statement_timestamp());
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_channel_rearm ON fairqueue_channel;
CREATE TRIGGER fairqueue_channel_rearm
    BEFORE UPDATE OF release_interval ON fairqueue_channel
    FOR EACH ROW
    WHEN (NEW.release_interval < OLD.release_interval)
    EXECUTE FUNCTION fairqueue_rearm_v1();

DROP TRIGGER IF EXISTS fairqueue_group_rearm ON fairqueue_channel_group;
CREATE TRIGGER fairqueue_group_rearm
    BEFORE UPDATE OF release_interval ON fairqueue_channel_group
    FOR EACH ROW
    WHEN (NEW.release_interval < OLD.release_interval)
    EXECUTE FUNCTION fairqueue_rearm_v1();


-- Lift group p_group after an operator raised its cap or weight or removed or shortened its
-- rate limit (models.ChannelGroup: save(), update(), bulk_update(), and so the admin), as
-- fairqueue_group_counters_v1 lifts a group that wakes: held back, it kept the low tag it had,
-- and the edit made it servable at once, so no wake lifts it and it would take every start
-- until it caught up. Lifted whether it is claimable or not, as fairqueue_fold_channel_v1 lifts
-- a channel: to the virtual time of the other flows (a group that is the smallest tag of all
-- loses at most its lead over the next one, bounded by one charge); a group with no work is
-- lifted again when a channel wakes it. Harmless by count (tags unused), but the model calls
-- this by time only. Its next turn comes forward when its rate limit was removed or shortened,
-- as fairqueue_fold_channel_v1 does for a channel's group. Lock order: the group's row only
-- (rank 3), nothing held before it.
CREATE OR REPLACE FUNCTION fairqueue_lift_group_v1(p_group bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- locked first, so the virtual time below is read after any claim holding it committed
    PERFORM FROM fairqueue_channel_group g WHERE g.id = p_group FOR UPDATE;
    UPDATE fairqueue_channel_group g
    SET next_turn_at = fairqueue_woken_turn_v1(g.next_turn_at, g.last_claimed_at,
                                               g.release_interval, statement_timestamp()),
        -- At most one message's charge ahead: the charge of the group's next message, the
        -- mean run time of its claimable channel of the smallest tag (the walk's first within
        -- the group, fq_channel_in_group_vtime_idx; the default with none) over the group's
        -- weight. The trigger charges the channel that wakes the group, which is that one: the
        -- group's only claimable channel.
        vtime = fairqueue_lift_v1(
            g.vtime, fairqueue_queue_virtual_time_v1(g.queue::text, NULL, g.id), false, true,
            fairqueue_charge_v1((SELECT c.mean_run FROM fairqueue_channel c
                                 WHERE c.group_id IS NOT NULL AND c.claimable
                                   AND c.group_id = g.id
                                 ORDER BY c.vtime, c.id
                                 LIMIT 1), g.weight))
    WHERE g.id = p_group;
END;
$$;
