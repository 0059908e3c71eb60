-- django-fairqueue server functions: unique holds. Whether a unique key is held, the hold
-- of a key by a running message of scope 'active', and a keyed message's return to the queue.

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


-- Whether a unique job p_id of scope 'queued' that would go back to the queue (a retry, a
-- release, a rescue) is superseded: another message already stands for the job, so p_id ends
-- cancelled rather than run the job twice. That message is
-- * one holding the key (fairqueue_unique_key_held_v1): a waiting one, whatever its age (the
--   index would refuse p_id beside it anyway), or a running holder of scope 'active';
-- * or one enqueued after p_id (a higher id: ids follow the inserts) that is running, whatever
--   its scope: it was enqueued after p_id's request, so its run does that request's work (a
--   free thread may well claim it before p_id's failure is settled).
-- An older running message does not count: it started before p_id's request. Nor does a newer
-- one that finished: a success cannot be told reliably (without keep_result the row is
-- deleted, and the pruner deletes the rest), and a failure, cancel or abort did not do the
-- work; p_id then retries, as it would had nobody taken the key (run again rather than lost).
-- Only going back to the queue asks this: what "held" means to an enqueue stays
-- fairqueue_unique_key_held_v1.
-- No index has the keys of running rows (the unique index holds waiting ones), so the running
-- look-up reads the running rows (fq_message_lease_idx: at most the fleet's slots, 2.5 ms for
-- 10,000), and only when nobody holds the key. `channel_id + 0` keeps the planner from ANDing
-- in fq_message_channel_idx, which reads every newer message of the channel (5 ms behind a
-- backlog of 100,000, and growing with it).
-- STABLE, no lock: a newer message the statement's snapshot shows waiting or running counts
-- in either state (a claim meanwhile does not hide it), and one enqueued after the snapshot
-- meets p_id back in the index (its insert waits for this transaction, then meets p_id as the
-- holder).
CREATE OR REPLACE FUNCTION fairqueue_unique_superseded_v1(
    p_channel_id bigint, p_unique_key text, p_id bigint
)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT fairqueue_unique_key_held_v1(p_channel_id, p_unique_key)
        OR EXISTS (
               SELECT FROM fairqueue_message o
               WHERE o.channel_id + 0 = p_channel_id AND o.unique_key = p_unique_key
                 AND o.state = 'running' AND o.id > p_id)
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
-- (message_store._run_back_to_queue) and its fresh snapshot sees the holder, so the message is
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
