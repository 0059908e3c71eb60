-- django-fairqueue: per-channel and per-minute statistics the workers flush.
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/stats_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: select_channel_window_stats
-- Per channel with statistics since `since`: claimed, succeeded, failed (for good), retried and timed out (of failed and retried) in that window.
-- Reads the rows of the window through fq_stat_minute_idx (or a scan when the window is most
-- of the table): one row per active channel and minute, never the message table.
SELECT s.channel_id, sum(s.claimed)::bigint, sum(s.succeeded)::bigint, sum(s.failed)::bigint,
       sum(s.retried)::bigint, sum(s.timed_out)::bigint
FROM fairqueue_channel_stat s
WHERE s.minute >= %(since)s::timestamptz
GROUP BY s.channel_id;

-- name: select_window_stats_of_channels
-- select_channel_window_stats for the channels of `ids` only (a page of the admin, status).
SELECT s.channel_id, sum(s.claimed)::bigint, sum(s.succeeded)::bigint, sum(s.failed)::bigint,
       sum(s.retried)::bigint, sum(s.timed_out)::bigint
FROM fairqueue_channel_stat s
WHERE s.channel_id = ANY (%(ids)s::bigint[]) AND s.minute >= %(since)s::timestamptz
GROUP BY s.channel_id;

-- name: record_channel_stats
-- Add workers' per-(channel, minute) tallies to fairqueue_channel_stat (upsert, sorted so concurrent flushes cannot deadlock).
-- timed_out counts, of failed and retried, the attempts that ran out of time.
INSERT INTO fairqueue_channel_stat AS s (
    channel_id, minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum,
    wait_ms_max, wait_histogram, run_ms_sum
)
SELECT t.channel_id, t.minute, t.claimed, t.succeeded, t.failed, t.retried, t.timed_out,
       t.wait_ms_sum, t.wait_ms_max, ARRAY(SELECT jsonb_array_elements_text(t.histogram)::integer),
       t.run_ms_sum
FROM unnest(%(channel_ids)s::bigint[], %(minutes)s::timestamptz[], %(claimed)s::integer[],
            %(succeeded)s::integer[], %(failed)s::integer[], %(retried)s::integer[],
            %(timed_out)s::integer[], %(wait_ms_sum)s::bigint[], %(wait_ms_max)s::integer[],
            %(histograms)s::jsonb[], %(run_ms_sum)s::bigint[])
     AS t(channel_id, minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum,
          wait_ms_max, histogram, run_ms_sum)
-- not for a channel deleted since the worker claimed from it: its rows went with it
WHERE EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = t.channel_id)
ORDER BY t.channel_id, t.minute
ON CONFLICT (channel_id, minute) DO UPDATE
SET claimed = s.claimed + EXCLUDED.claimed,
    succeeded = s.succeeded + EXCLUDED.succeeded,
    failed = s.failed + EXCLUDED.failed,
    retried = s.retried + EXCLUDED.retried,
    timed_out = s.timed_out + EXCLUDED.timed_out,
    wait_ms_sum = s.wait_ms_sum + EXCLUDED.wait_ms_sum,
    wait_ms_max = greatest(s.wait_ms_max, EXCLUDED.wait_ms_max),
    wait_histogram = ARRAY(
        SELECT coalesce(a, 0) + coalesce(b, 0)
        FROM unnest(s.wait_histogram, EXCLUDED.wait_histogram) AS h(a, b)
    ),
    run_ms_sum = s.run_ms_sum + EXCLUDED.run_ms_sum;

-- name: record_minute_stats
-- Add the same flush's sums per minute (all its channels together) to fairqueue_minute_stat, in the transaction of record_channel_stats and after it.
-- Lock order: the flush's channel rows first (record_channel_stats, by channel then minute), then
-- these minute rows by minute. Two flushes that meet wait on a channel row before either holds a
-- minute row, or on minute rows taken in one order: no cycle. A minute row is shared by every
-- worker, but held only for the rest of one flush's short transaction.
INSERT INTO fairqueue_minute_stat AS s (
    minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum, wait_ms_max,
    wait_histogram, run_ms_sum
)
SELECT t.minute, t.claimed, t.succeeded, t.failed, t.retried, t.timed_out, t.wait_ms_sum,
       t.wait_ms_max, ARRAY(SELECT jsonb_array_elements_text(t.histogram)::integer), t.run_ms_sum
FROM unnest(%(minutes)s::timestamptz[], %(claimed)s::bigint[], %(succeeded)s::bigint[],
            %(failed)s::bigint[], %(retried)s::bigint[], %(timed_out)s::bigint[],
            %(wait_ms_sum)s::bigint[], %(wait_ms_max)s::integer[], %(histograms)s::jsonb[],
            %(run_ms_sum)s::bigint[])
     AS t(minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum, wait_ms_max,
          histogram, run_ms_sum)
ORDER BY t.minute
ON CONFLICT (minute) DO UPDATE
SET claimed = s.claimed + EXCLUDED.claimed,
    succeeded = s.succeeded + EXCLUDED.succeeded,
    failed = s.failed + EXCLUDED.failed,
    retried = s.retried + EXCLUDED.retried,
    timed_out = s.timed_out + EXCLUDED.timed_out,
    wait_ms_sum = s.wait_ms_sum + EXCLUDED.wait_ms_sum,
    wait_ms_max = greatest(s.wait_ms_max, EXCLUDED.wait_ms_max),
    wait_histogram = ARRAY(
        SELECT coalesce(a, 0) + coalesce(b, 0)
        FROM unnest(s.wait_histogram, EXCLUDED.wait_histogram) AS h(a, b)
    ),
    run_ms_sum = s.run_ms_sum + EXCLUDED.run_ms_sum;

-- name: prune_channel_stats
-- Delete per-minute channel statistics, and their sums per minute, older than `before`.
WITH minutes AS (
    DELETE FROM fairqueue_minute_stat m WHERE m.minute < %(before)s::timestamptz
)
DELETE FROM fairqueue_channel_stat s WHERE s.minute < %(before)s::timestamptz;

-- name: record_usage_hours
-- Add a statistics flush's usage per (channel, hour) to fairqueue_usage, with the channel's and
-- its group's names as they are now (usage outlives a deleted channel, so they are copied).
-- In the flush's transaction, after the per-minute rows: the lock order is the channel's minute
-- rows, the minute rows, then these hour rows by (hour, channel), then the total rows by
-- channel (record_usage_totals). A channel deleted since the claim has no usage written.
INSERT INTO fairqueue_usage AS u (
    hour, channel_id, channel_name, group_name, attempts, succeeded, failures, timeouts,
    worker_ms
)
SELECT t.hour, t.channel_id, c.name, coalesce(g.name, ''), t.attempts, t.succeeded,
       t.failures, t.timeouts, t.worker_ms
FROM unnest(%(hours)s::timestamptz[], %(channel_ids)s::bigint[], %(attempts)s::bigint[],
            %(succeeded)s::bigint[], %(failures)s::bigint[], %(timeouts)s::bigint[],
            %(worker_ms)s::bigint[])
     AS t(hour, channel_id, attempts, succeeded, failures, timeouts, worker_ms)
JOIN fairqueue_channel c ON c.id = t.channel_id
LEFT JOIN fairqueue_channel_group g ON g.id = c.group_id
ORDER BY t.hour, t.channel_id
ON CONFLICT (hour, channel_id) DO UPDATE
SET channel_name = EXCLUDED.channel_name,
    group_name = EXCLUDED.group_name,
    attempts = u.attempts + EXCLUDED.attempts,
    succeeded = u.succeeded + EXCLUDED.succeeded,
    failures = u.failures + EXCLUDED.failures,
    timeouts = u.timeouts + EXCLUDED.timeouts,
    worker_ms = u.worker_ms + EXCLUDED.worker_ms;

-- name: record_usage_totals
-- Add the same flush's usage per channel to fairqueue_usage_total (never pruned: the metrics'
-- counters), in channel order, after record_usage_hours.
INSERT INTO fairqueue_usage_total AS u (
    channel_id, attempts, succeeded, failures, timeouts, worker_ms
)
SELECT t.channel_id, t.attempts, t.succeeded, t.failures, t.timeouts, t.worker_ms
FROM unnest(%(channel_ids)s::bigint[], %(attempts)s::bigint[], %(succeeded)s::bigint[],
            %(failures)s::bigint[], %(timeouts)s::bigint[], %(worker_ms)s::bigint[])
     AS t(channel_id, attempts, succeeded, failures, timeouts, worker_ms)
WHERE EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = t.channel_id)
ORDER BY t.channel_id
ON CONFLICT (channel_id) DO UPDATE
SET attempts = u.attempts + EXCLUDED.attempts,
    succeeded = u.succeeded + EXCLUDED.succeeded,
    failures = u.failures + EXCLUDED.failures,
    timeouts = u.timeouts + EXCLUDED.timeouts,
    worker_ms = u.worker_ms + EXCLUDED.worker_ms;

-- name: prune_usage
-- Delete usage hours older than `before` (the leading hour of fq_usage_hour_channel), and the
-- totals of channels deleted since (their series leave the metrics with them).
WITH totals AS (
    DELETE FROM fairqueue_usage_total t
    WHERE NOT EXISTS (SELECT FROM fairqueue_channel c WHERE c.id = t.channel_id)
)
DELETE FROM fairqueue_usage u WHERE u.hour < %(before)s::timestamptz;
