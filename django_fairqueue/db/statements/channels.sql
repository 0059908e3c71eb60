-- django-fairqueue: channels and channel groups: creation, names, counters, limits and
-- scheduler state.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/channel_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: create_channels
-- Create the named channels that do not exist (in name order), on a connection of its own, committed at once.
-- The lock timeout bounds the wait for a name another transaction is creating right now.
WITH timeout AS MATERIALIZED (
    SELECT set_config('lock_timeout', %(lock_timeout)s::text, true)
)
INSERT INTO fairqueue_channel (name, max_concurrency, release_interval, weight, paused,
                               max_backlog, created_at, next_turn_at)
SELECT n, %(default_max_concurrency)s::integer, %(default_release_interval)s::interval,
       %(default_weight)s::integer, false, %(default_max_backlog)s::integer, clock_timestamp(),
       clock_timestamp()
FROM timeout, unnest(%(names)s::text[]) AS n
ORDER BY n
ON CONFLICT (name) DO NOTHING;

-- name: ensure_groups
-- Create the named channel groups that do not exist (fairqueue_ensure_groups_v1).
SELECT fairqueue_ensure_groups_v1(%(names)s::text[]);

-- name: fold_channel_deltas prepared
-- Fold up to `limit` of the oldest pending counter deltas into their channel rows: every kind
-- (maintenance; claims fold what they need), or with `wake_only` those that can make a channel
-- claimable (new work, freed slots, newly pending batches; see select_waking_backlog).
SELECT fairqueue_fold_deltas_v1(
    %(limit)s::integer, %(wake_only)s::boolean, %(by_time)s::boolean
) AS folded;

-- name: fold_drained_markers prepared
-- Fold the drained markers and their channels' quiet deltas (fairqueue_fold_deltas_v1's drained
-- mode; the claims' housekeeping does the same): the maintenance loop's, after its fold of
-- every kind, in a transaction of its own (one that held that fold's deltas as it deleted
-- quiet ones could deadlock with another worker's loop doing the same).
SELECT fairqueue_fold_deltas_v1(1000, true, %(by_time)s::boolean, true) AS folded;

-- name: select_channel_counters
-- Channel counters including deltas not yet folded: exact, and bounded by the delta backlog.
SELECT c.id, c.name,
       c.ready_count + coalesce(d.ready, 0) AS ready,
       c.scheduled_count + coalesce(d.scheduled, 0) AS scheduled,
       c.running_count + coalesce(d.running, 0) AS running,
       c.failed_count + coalesce(d.failed, 0) AS failed,
       c.succeeded_total + coalesce(d.succeeded, 0) AS succeeded
FROM fairqueue_channel c
LEFT JOIN LATERAL (
    SELECT sum(x.ready) AS ready, sum(x.scheduled) AS scheduled, sum(x.running) AS running,
           sum(x.failed) AS failed, sum(x.succeeded) AS succeeded
    FROM fairqueue_channel_delta x
    WHERE x.channel_id = c.id
) d ON true
WHERE c.id = ANY (%(ids)s::bigint[])
ORDER BY c.id;

-- name: select_group_state
-- Channel groups (of `ids`, or all) with their scheduler state, for operators (status, the
-- admin): ready, running and claimable summed over their channels with the counter changes not
-- folded yet, as select_all_channel_counts shows each channel (the folded sums, which the
-- trigger keeps in step with the channels' folded counters, lag until maintenance folds), and
-- how many channels each has. One pass over each group's channels (fq_channel_group_idx), a
-- probe of fq_delta_channel_idx per channel.
SELECT g.id, g.name::text, g.weight, g.max_concurrency, g.release_interval,
       coalesce(s.ready, 0), coalesce(s.running, 0), coalesce(s.claimable, 0),
       coalesce(s.channels, 0), g.next_turn_at, g.vtime, g.last_claimed_at
FROM fairqueue_channel_group g
LEFT JOIN LATERAL (
    SELECT count(*) AS channels,
           sum(c.ready_count + coalesce(d.ready, 0))::bigint AS ready,
           sum(c.running_count + coalesce(d.running, 0))::bigint AS running,
           count(*) FILTER (
               WHERE c.ready_count + coalesce(d.ready, 0) > 0
                 AND NOT c.paused
                 AND (c.max_concurrency IS NULL
                      OR c.running_count + coalesce(d.running, 0) < c.max_concurrency)
           )::integer AS claimable
    FROM fairqueue_channel c
    LEFT JOIN LATERAL (
        SELECT sum(x.ready) AS ready, sum(x.running) AS running
        FROM fairqueue_channel_delta x
        WHERE x.channel_id = c.id
    ) d ON true
    WHERE c.group_id IS NOT NULL AND c.group_id = g.id
) s ON true
WHERE %(ids)s::bigint[] IS NULL OR g.id = ANY (%(ids)s::bigint[])
ORDER BY g.name;

-- name: select_all_channel_counts
-- Every channel's configuration and counters including deltas not yet folded (admin, status, metrics).
-- One scan of the channel table hash-joined to the deltas summed once per channel: cheaper than a
-- correlated sum per channel row, and bounded by the channels plus the delta backlog.
SELECT c.id, c.name, c.weight, c.paused, c.max_concurrency,
       c.ready_count + coalesce(d.ready, 0),
       c.scheduled_count + coalesce(d.scheduled, 0),
       c.running_count + coalesce(d.running, 0),
       c.failed_count + coalesce(d.failed, 0),
       c.succeeded_total + coalesce(d.succeeded, 0)
FROM fairqueue_channel c
LEFT JOIN (
    SELECT x.channel_id, sum(x.ready)::bigint AS ready, sum(x.scheduled)::bigint AS scheduled,
           sum(x.running)::bigint AS running, sum(x.failed)::bigint AS failed,
           sum(x.succeeded)::bigint AS succeeded
    FROM fairqueue_channel_delta x
    GROUP BY x.channel_id
) d ON d.channel_id = c.id;

-- name: fold_deltas_of_channel
-- Fold one channel's pending deltas now (after an operator changes its limits, so a new cap sees exact counts).
SELECT fairqueue_fold_channel_v1(%(channel_id)s::bigint) AS folded;

-- name: lift_group
-- Lift one channel group to its queue's virtual time now (after an operator eases its limits, so it does not take every start).
SELECT fairqueue_lift_group_v1(%(group_id)s::bigint);

-- name: level_channel_tags
-- Level every channel's tag (fairness by time) at 0, as on a fresh install: channel rows in id order (the lock order), waiting for claims that hold them; how many moved.
WITH moved AS (
    UPDATE fairqueue_channel c
    SET vtime = 0
    FROM (SELECT x.id FROM fairqueue_channel x WHERE x.vtime <> 0 ORDER BY x.id FOR UPDATE) l
    WHERE c.id = l.id
    RETURNING 1
)
SELECT count(*) FROM moved;

-- name: level_group_tags
-- Level every channel group's tag at 0 (after the channels': groups come second in the lock order); how many moved.
WITH moved AS (
    UPDATE fairqueue_channel_group g
    SET vtime = 0
    FROM (SELECT x.id FROM fairqueue_channel_group x WHERE x.vtime <> 0 ORDER BY x.id FOR UPDATE) l
    WHERE g.id = l.id
    RETURNING 1
)
SELECT count(*) FROM moved;

-- name: lock_channel_names
-- Hold channel names against enqueues until the transaction ends (deleting the channels): the
-- names' locks in name order, then their stripes' in stripe order (an enqueue of many names
-- holds those instead; see fairqueue_channel_stripe_key_v1).
SELECT pg_advisory_xact_lock(fairqueue_channel_lock_key_v1(), x.key)
FROM (SELECT hashtext(n) AS key FROM unnest(%(names)s::text[]) AS n ORDER BY n) x
UNION ALL
SELECT pg_advisory_xact_lock(fairqueue_channel_stripe_key_v1(), s.stripe)
FROM (SELECT DISTINCT fairqueue_lock_stripe_v1(hashtext(n)) AS stripe
      FROM unnest(%(names)s::text[]) AS n ORDER BY 1) s;

-- name: share_channel_name
-- Take a channel name's lock as an enqueue does (shared, to the end of the transaction), before
-- a statement that locks rows a deletion of the channel also locks (a schedule's firing).
SELECT pg_advisory_xact_lock_shared(fairqueue_channel_lock_key_v1(), hashtext(%(name)s::text));

-- name: select_channel_ids
-- Channel ids for names (unknown names are absent from the result).
SELECT c.id, c.name FROM fairqueue_channel c WHERE c.name = ANY (%(names)s::text[]);

-- name: select_channel_ids_in_queues
-- Channel rows of channel names in queues (NULL: every queue), with each row's queue and
-- name within it. A worker's channel filters, resolved once a minute: the rows of other
-- queues than the default are named '<queue>' || chr(31) || '<name>' (fairqueue_queue_of_name_v1).
SELECT c.id, c.queue::text, CASE WHEN c.queue = 'default' THEN c.name::text
                                 ELSE substr(c.name, length(c.queue) + 2) END
FROM fairqueue_channel c
WHERE (c.queue = 'default' OR strpos(c.name, chr(31)) > 1)
  AND (%(queues)s::text[] IS NULL OR c.queue = ANY (%(queues)s::text[]))
  AND CASE WHEN c.queue = 'default' THEN c.name::text
           ELSE substr(c.name, length(c.queue) + 2) END = ANY (%(names)s::text[]);

-- name: select_channel_oldest_ready
-- Per channel with ready messages: since when its longest-waiting head of line has been ready.
-- A loose index scan of fq_message_ready_idx (channel_id, priority DESC, id): the first row of
-- each priority level, each found by one LIMIT 1 probe restarted below the previous level, so a
-- channel costs one probe per priority level in use (usually one), never a scan of its backlog.
-- The first row of a level is its oldest message (ids grow with enqueue). "Ready since" is
-- greatest(enqueued_at, run_at): a delayed message or a retry is claimable from its run_at.
SELECT c.id, o.ready_since
FROM unnest(%(ids)s::bigint[]) AS c(id)
CROSS JOIN LATERAL (
    WITH RECURSIVE heads(priority, ready_since) AS (
        (SELECT m.priority, greatest(m.enqueued_at, m.run_at)
         FROM fairqueue_message m
         WHERE m.channel_id = c.id AND m.state = 'ready'
         ORDER BY m.priority DESC, m.id
         LIMIT 1)
        UNION ALL
        SELECT n.priority, n.ready_since
        FROM heads h
        CROSS JOIN LATERAL (
            SELECT m.priority, greatest(m.enqueued_at, m.run_at) AS ready_since
            FROM fairqueue_message m
            WHERE m.channel_id = c.id AND m.state = 'ready' AND m.priority < h.priority
            ORDER BY m.priority DESC, m.id
            LIMIT 1
        ) n
    )
    SELECT min(heads.ready_since) AS ready_since FROM heads
) o
WHERE o.ready_since IS NOT NULL;

-- name: select_backlogged_oldest_ready
-- select_channel_oldest_ready for every channel whose counters (plus pending deltas) say it has ready messages: no list of ids sent.
-- The same loose index scan per channel; the channels are picked here, so a caller ranking every
-- backlogged channel (the admin's sort by oldest ready, its "oldest ready waits over N" filter)
-- neither reads every channel's counters first nor sends them back as a parameter.
SELECT c.id, o.ready_since
FROM fairqueue_channel c
LEFT JOIN (
    SELECT x.channel_id, sum(x.ready) AS ready
    FROM fairqueue_channel_delta x
    GROUP BY x.channel_id
) d ON d.channel_id = c.id
CROSS JOIN LATERAL (
    WITH RECURSIVE heads(priority, ready_since) AS (
        (SELECT m.priority, greatest(m.enqueued_at, m.run_at)
         FROM fairqueue_message m
         WHERE m.channel_id = c.id AND m.state = 'ready'
         ORDER BY m.priority DESC, m.id
         LIMIT 1)
        UNION ALL
        SELECT n.priority, n.ready_since
        FROM heads h
        CROSS JOIN LATERAL (
            SELECT m.priority, greatest(m.enqueued_at, m.run_at) AS ready_since
            FROM fairqueue_message m
            WHERE m.channel_id = c.id AND m.state = 'ready' AND m.priority < h.priority
            ORDER BY m.priority DESC, m.id
            LIMIT 1
        ) n
    )
    SELECT min(heads.ready_since) AS ready_since FROM heads
) o
WHERE c.ready_count + coalesce(d.ready, 0) > 0 AND o.ready_since IS NOT NULL;

-- name: ensure_channel
-- The id of a channel, created with the default limits when missing (planning a job names one).
WITH created AS (
    INSERT INTO fairqueue_channel AS c (
        name, max_concurrency, release_interval, weight, paused, max_backlog,
        next_turn_at, turn_used, ready_count, scheduled_count, running_count,
        failed_count, succeeded_total, created_at
    )
    VALUES (%(name)s::text, %(default_max_concurrency)s::integer,
            %(default_release_interval)s::interval, %(default_weight)s::integer, false,
            %(default_max_backlog)s::integer, clock_timestamp(), 0, 0, 0, 0, 0, 0,
            clock_timestamp())
    ON CONFLICT (name) DO NOTHING
    RETURNING c.id
)
SELECT created.id FROM created
UNION ALL
-- this statement's snapshot does not see `created`'s row, so the name appears once
SELECT c.id FROM fairqueue_channel c WHERE c.name = %(name)s::text;

-- name: select_channel_wait_state
-- What the "why is this waiting" sentence needs of one channel, read lock-free: its limits and exact counters, its turn, how many claimable channels come before it in the round, since when its oldest running message runs, and the messages claimed in the last 5 minutes over all channels.
-- The channels ahead are counted on fq_channel_turn_idx (its predicate repeated word for word):
-- the claimable channels whose turn comes before this one's; by time, on fq_channel_vtime_idx,
-- those whose tag is smaller.
SELECT c.name::text, c.paused, c.max_concurrency, c.release_interval, c.next_turn_at,
       c.ready_count + coalesce(d.ready, 0) AS ready,
       c.running_count + coalesce(d.running, 0) AS running,
       clock_timestamp() AS now,
       CASE WHEN NOT %(by_time)s::boolean THEN
           (SELECT count(*)
            FROM fairqueue_channel o
            WHERE o.claimable
              AND (o.next_turn_at, o.id) < (c.next_turn_at, c.id)
              AND o.next_turn_at <= clock_timestamp())
       ELSE  -- fairness by time: the claimable channels of smaller tags (fq_channel_vtime_idx)
           (SELECT count(*)
            FROM fairqueue_channel o
            WHERE o.claimable
              AND (o.vtime, o.id) < (c.vtime, c.id)
              AND (o.release_interval = interval '0' OR o.next_turn_at <= clock_timestamp()))
       END AS ahead,
       (SELECT min(m.claimed_at)
        FROM fairqueue_message m
        WHERE m.state = 'running' AND m.channel_id = c.id) AS oldest_running_since,
       (SELECT coalesce(sum(s.claimed), 0)
        FROM fairqueue_channel_stat s
        WHERE s.minute >= date_trunc('minute', clock_timestamp()) - interval '4 minutes')
        AS claimed_recently,
       -- its group's limits, as the claim checks them: the running count with its channels'
       -- settlements not folded yet (fq_channel_group_idx, fq_delta_channel_idx), and its turn
       -- as the fold would set it were the channel made claimable now (as select_next_due does)
       g.name::text AS group_name, g.max_concurrency AS group_max_concurrency,
       g.running_count + coalesce((
           SELECT sum(gd.running)
           FROM fairqueue_channel gc
           JOIN fairqueue_channel_delta gd ON gd.channel_id = gc.id
           WHERE gc.group_id IS NOT NULL AND gc.group_id = g.id), 0) AS group_running,
       g.release_interval AS group_release_interval,
       CASE WHEN g.claimable > 0 THEN g.next_turn_at
            ELSE fairqueue_woken_turn_v1(g.next_turn_at, g.last_claimed_at, g.release_interval,
                                         clock_timestamp())
       END AS group_next_turn_at
FROM fairqueue_channel c
LEFT JOIN LATERAL (
    SELECT sum(x.ready) AS ready, sum(x.running) AS running
    FROM fairqueue_channel_delta x
    WHERE x.channel_id = c.id
) d ON true
LEFT JOIN fairqueue_channel_group g ON g.id = c.group_id
WHERE c.id = %(channel_id)s::bigint;

-- name: select_channel_retrying
-- Per channel of `ids`: messages waiting out a retry's backoff (scheduled after a failed attempt).
-- A scheduled message with attempts > 0 has run and failed: enqueue and retry_failed_messages
-- start at 0, release_messages gives the attempt back. Walks fq_message_retrying_idx
-- (channel_id, partial: exactly these rows), so delayed messages beside them cost nothing;
-- callers pass the channels whose scheduled counter is positive.
SELECT m.channel_id, count(*)
FROM fairqueue_message m
WHERE m.channel_id = ANY (%(ids)s::bigint[]) AND m.state = 'scheduled' AND m.attempts > 0
GROUP BY m.channel_id;

-- name: select_waking_backlog prepared
-- Whether more than `beyond` waking counter deltas wait to be folded (see the function).
SELECT fairqueue_waking_backlog_v1(%(beyond)s::integer);
