-- django-fairqueue server functions: enqueue. Batches and single messages, and unique keys
-- at enqueue.

-- Whether an enqueue's counter delta wakes the claim (fairqueue_channel_delta.wake): unless the
-- enqueue holds its channel's name and the channel counts ready messages already and is in no
-- group (p_counted, read in the enqueue's statement, at READ COMMITTED: a snapshot older than
-- the name lock could read a count a claim has since taken), or its messages are scheduled.
-- A channel that counts ready messages is claimable whatever this delta adds, so folding it
-- before every claim (three statements and a new version of the channel row, a third of a
-- claim of one's server time in steady traffic) would buy nothing; the maintenance loop
-- folds it in bulk. The count may run out first: a claim about to take all a channel counts
-- adds its quiet deltas first, and whatever brings a count to zero without holding the
-- channel's name (an enqueue may be in flight) leaves a marker (`drained`) that a claim's fold
-- takes up once no enqueue holds the name (fairqueue_claim_v1, steps 1, 3b and 5;
-- fairqueue_fold_deltas_v1). A scheduled message's delta wakes: its promotion's delta, which
-- wakes, takes it out of scheduled_count, and must not be folded before the delta that put it
-- in. A grouped channel's wakes: the claim of a group's channels does not count quiet deltas
-- before it takes all a channel counts (fairqueue_claim_v1, step 3b), so they would make its
-- claims short.
CREATE OR REPLACE FUNCTION fairqueue_delta_wakes_v1(p_counted boolean, p_scheduled boolean)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT p_scheduled OR NOT coalesce(p_counted, false)
           OR current_setting('transaction_isolation') <> 'read committed'
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
-- The bound of p_bounded channels' max_backlog comes last, on the messages inserted, and locks
-- nothing (the check at commit takes its stripes then, as for any enqueue).
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
-- Never a sequential scan (see fairqueue_claim_v1): a plan made while the channel table was
-- small read the whole table on every enqueue until the table's next ANALYZE.
SET enable_seqscan = off
AS $$
DECLARE
    v_n integer := cardinality(p_payloads);
    v_cids bigint[];
    v_plain bigint[];
    v_kid bigint[];
    v_kch bigint[];
    v_kkey text[];
    v_kscope text[];
    v_bid bigint[];
    v_bn bigint[];
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
                RETURNING channel_id, ready + scheduled AS n, backlog_check
            )
            SELECT array_agg(inserted.id ORDER BY inserted.id) FILTER (WHERE inserted.unique_key IS NULL),
                   array_agg(inserted.id) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   array_agg(inserted.channel_id) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   array_agg(inserted.unique_key) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   array_agg(inserted.unique_scope) FILTER (WHERE inserted.unique_key IS NOT NULL),
                   -- what the batch adds to each bounded channel, for the bound below
                   (SELECT array_agg(d.channel_id ORDER BY d.channel_id) FROM delta d
                    WHERE d.backlog_check),
                   (SELECT array_agg(d.n ORDER BY d.channel_id) FROM delta d WHERE d.backlog_check)
            INTO v_plain, v_kid, v_kch, v_kkey, v_kscope, v_bid, v_bn
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
            -- The bound of max_backlog, on the messages the batch inserted only: a kept or
            -- replaced one adds no waiting message, so a full channel does not refuse it, and a
            -- raise has raised DuplicateJob above. (After the held keys: their policies first.)
            IF v_bid IS NOT NULL THEN
                PERFORM fairqueue_bound_backlog_v1(v_bid, v_bn, true);
            END IF;
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
-- raises SQLSTATE FQ001 and nothing of the batch is stored. Only messages the batch adds
-- count: a unique job whose held key is kept or replaced adds none (with "raise", SQLSTATE
-- FQ003 comes first). The bound needs READ COMMITTED (a REPEATABLE READ snapshot cannot see
-- the enqueues committed meanwhile): at any other isolation level a batch for a bounded
-- channel raises SQLSTATE FQ002.
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
LANGUAGE plpgsql
SET enable_seqscan = off  -- see fairqueue_enqueue_unique_v1
AS $$
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
    v_counted boolean;
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
    -- them, so the statements below see any deletion that committed first; many names by
    -- their stripes (fairqueue_lock_stripe_v1: the lock table is shared by every session).
    IF cardinality(v_names) <= 128 THEN
        PERFORM pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), hashtext(n))
        FROM unnest(v_names) AS n;
    ELSE
        PERFORM pg_advisory_xact_lock_shared(fairqueue_channel_stripe_key_v1(), s.stripe)
        FROM (SELECT DISTINCT fairqueue_lock_stripe_v1(hashtext(n)) AS stripe
              FROM unnest(v_names) AS n ORDER BY 1) s;
    END IF;

    -- (v_cid: the channel of a uniform batch, which has one; v_counted: whether it counts
    -- ready messages already, ungrouped, which makes the batch's delta quiet:
    -- fairqueue_delta_wakes_v1)
    SELECT count(*), array_agg(c.id) FILTER (WHERE c.max_backlog IS NOT NULL), min(c.id),
           bool_and(c.ready_count > 0 AND c.group_id IS NULL)
    INTO v_found, v_bounded, v_cid, v_counted
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
        SELECT array_agg(c.id) FILTER (WHERE c.max_backlog IS NOT NULL), min(c.id)
        INTO v_bounded, v_cid
        FROM fairqueue_channel c WHERE c.name = ANY (v_names);
    END IF;

    IF v_bounded IS NOT NULL THEN
        -- In id order, the order they are locked in. Sorted here, not in the aggregates above:
        -- for an ORDER BY there a plan read every channel by primary key to get that order.
        v_bounded := ARRAY(SELECT b.id FROM unnest(v_bounded) AS b(id) ORDER BY b.id);
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'fairqueue: a channel with max_backlog accepts messages only in '
                            'READ COMMITTED transactions; this one is %',
                            upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'FQ002',
                      HINT = 'Enqueue outside the REPEATABLE READ / SERIALIZABLE transaction, '
                             'or clear the channel''s max_backlog.';
        END IF;
        -- Every message of a batch without unique keys adds one, so it is bounded before
        -- its insert. A batch with keys is bounded after its insert, on what it inserted
        -- (fairqueue_enqueue_unique_v1): a held key's keep or replace adds nothing.
        IF p_unique_keys IS NULL THEN
            IF v_uniform THEN  -- (p_channels has its one element: all messages are its)
                v_want := ARRAY[v_n];
            ELSE
                SELECT array_agg(coalesce(w.n, 0) ORDER BY b.id) INTO v_want
                FROM unnest(v_bounded) AS b(id)
                JOIN fairqueue_channel c ON c.id = b.id
                LEFT JOIN (
                    SELECT n AS name, count(*) AS n FROM unnest(p_channels) AS n GROUP BY n
                ) w ON w.name = c.name;
            END IF;
            PERFORM fairqueue_bound_backlog_v1(v_bounded, v_want, false);
        END IF;
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
                channel_id, ready, scheduled, running, failed, succeeded, backlog_check, wake
            )
            SELECT v_cid,
                   CASE WHEN v_run_at > v_now THEN 0 ELSE count(*) END,
                   CASE WHEN v_run_at > v_now THEN count(*) ELSE 0 END,
                   0, 0, 0, v_bounded IS NOT NULL,
                   fairqueue_delta_wakes_v1(v_counted, v_run_at > v_now)
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
            channel_id, ready, scheduled, running, failed, succeeded, backlog_check, wake
        )
        SELECT inserted.channel_id,
               count(*) FILTER (WHERE inserted.state = 'ready'),
               count(*) FILTER (WHERE inserted.state = 'scheduled'),
               0, 0, 0,
               coalesce(inserted.channel_id = ANY (v_bounded), false),
               -- (many names are held by their stripes, not by name: such a batch wakes)
               fairqueue_delta_wakes_v1(
                   cardinality(v_names) <= 128
                   AND (SELECT c.ready_count > 0 AND c.group_id IS NULL
                        FROM fairqueue_channel c WHERE c.id = inserted.channel_id),
                   bool_or(inserted.state = 'scheduled'))
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
    --   which costs nothing more to read), less the ready messages taken out since by a
    --   cancel, purge, delete or abort whose delta no fold has added yet (the partial index
    --   fq_delta_lowered_idx holds exactly those deltas: one probe, almost always of nothing,
    --   and only when the count is above zero), is above zero. Without them, an idle channel
    --   an operator emptied still counted its messages, and the next enqueue woke nobody
    --   (a removal still in flight when this statement runs is not seen: the workers' poll
    --   finds that message). A claim leaves ready messages behind
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
              AND CASE WHEN CASE WHEN c.ready_count > 0 THEN c.ready_count + coalesce((
                                     SELECT sum(d.ready) FROM fairqueue_channel_delta d
                                     WHERE d.channel_id = c.id AND d.ready < 0), 0) > 0 END
                       THEN true ELSE EXISTS (
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
-- backlogged (ready_count above zero, less what a cancel, purge, delete or abort took out
-- since: fq_delta_lowered_idx). Otherwise the head is read before the insert, in the
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
LANGUAGE plpgsql
SET enable_seqscan = off  -- see fairqueue_enqueue_unique_v1
AS $$
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
    -- lock is the one fairqueue_enqueue_v1 takes; it waits only while a deletion holds it, or a
    -- claim that drains the channel commits: fairqueue_free_names_v1.)
    IF NOT pg_try_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), v_key) THEN
        PERFORM pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), v_key);
    END IF;
    WITH ch AS (
        -- (`backlogged`: fairqueue_enqueue_v1's test, read once)
        SELECT c.id, c.group_id,
               CASE WHEN c.ready_count > 0 THEN c.ready_count + coalesce((
                        SELECT sum(d.ready) FROM fairqueue_channel_delta d
                        WHERE d.channel_id = c.id AND d.ready < 0), 0) > 0
                    ELSE false END AS backlogged
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
            channel_id, ready, scheduled, running, failed, succeeded, backlog_check, wake
        )
        SELECT inserted.channel_id, (v_run_at <= v_now)::integer, (v_run_at > v_now)::integer,
               0, 0, 0, false,
               fairqueue_delta_wakes_v1((SELECT ch.backlogged AND ch.group_id IS NULL FROM ch),
                                        v_run_at > v_now)
        FROM inserted
    )
    SELECT inserted.id,
           CASE WHEN (SELECT ch.backlogged FROM ch) THEN true
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
