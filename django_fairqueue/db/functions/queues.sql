-- django-fairqueue server functions: queues. The queue a channel or group row's name
-- declares (kept in its queue column by a trigger), and which queues have claimable work.

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
                    WHERE c.claimable
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
