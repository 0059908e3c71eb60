-- django-fairqueue server functions: bounded backlog. The check of a channel's max_backlog,
-- at enqueue and again when the enqueuing transaction commits (a constraint trigger on the
-- counter deltas an enqueue writes).

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


-- An enqueue's bound of max_backlog: p_batch[i] more waiting messages for each bounded channel
-- of p_ids (p_included: as fairqueue_check_backlog_v1's), checked at once, lock-free (a channel
-- already full refuses without waiting for the commit), and recorded in fairqueue.bounded for
-- the exact check at commit (fairqueue_backlog_check_v1).
CREATE OR REPLACE FUNCTION fairqueue_bound_backlog_v1(
    p_ids bigint[], p_batch bigint[], p_included boolean
)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM fairqueue_check_backlog_v1(p_ids, p_batch, p_included);
    PERFORM set_config(
        'fairqueue.bounded',
        concat_ws(',', nullif(current_setting('fairqueue.bounded', true), ''),
                  (SELECT string_agg(x.id || ':' || x.n, ',')
                   FROM unnest(p_ids, p_batch) AS x(id, n))),
        true);
END;
$$;


-- The bound of max_backlog, checked when the enqueuing transaction commits (a deferred
-- constraint trigger on the delta rows enqueue marks with backlog_check). An enqueue inside a
-- transaction holds no lock for the bound; at commit, the transaction takes the advisory lock
-- of each bounded channel it enqueued to (its id's stripe, fairqueue_lock_stripe_v1: at most
-- 128 locks of the lock table every session shares), all at once and in stripe order, checks
-- every channel with a fresh snapshot (which sees what earlier holders committed), and keeps
-- the locks for the moment of its commit only. Two transactions touching the same channels in
-- opposite orders can therefore not deadlock, however many enqueue() calls each made; two of
-- different channels wait for each other only when a stripe is shared, for a commit's time.
-- The channels to check, with how many messages the transaction enqueued to each, travel in
-- the transaction-local setting fairqueue.bounded as "id:n,id:n" (a savepoint rolled back takes
-- its part of the list with it, as it takes its deltas).
CREATE OR REPLACE FUNCTION fairqueue_backlog_check_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_batch bigint[];
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
    PERFORM pg_advisory_xact_lock(fairqueue_lock_key_v1(), s.stripe)
    FROM (SELECT DISTINCT fairqueue_lock_stripe_v1(x.id) AS stripe
          FROM unnest(v_ids) AS x(id) ORDER BY 1) s;
    PERFORM fairqueue_check_backlog_v1(v_ids, v_batch, true);
    RETURN NULL;
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
