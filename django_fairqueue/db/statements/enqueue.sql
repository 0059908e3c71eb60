-- django-fairqueue: the statements that insert messages (the way into the queue).
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/enqueue_store.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: enqueue_messages prepared
-- Insert a batch of messages (creating channels on first use) in one round trip.
-- Parameters are bound in binary (the b placeholders): arrays then need no quoting or escaping per
-- element on either side. Payloads come as JSON text (text[]), checked by the caller.
SELECT id FROM fairqueue_enqueue_v1(
    %(channels)b::text[], %(tasks)b::text[], %(payloads)b::text[]::jsonb[],
    %(priorities)b::smallint[], %(run_at)b::timestamptz[], %(max_attempts)b::integer[],
    %(keep_result)b::boolean[], %(default_max_concurrency)b::integer,
    %(default_release_interval)b::interval, %(default_weight)b::integer,
    %(default_max_backlog)b::integer, %(notify_channel)b::text, %(delays)b::interval[],
    %(create)b::boolean, %(unique_keys)b::text[], %(unique_scopes)b::text[],
    %(on_conflict)b::text[]
) AS id;

-- name: enqueue_message prepared
-- Insert one message (creating its channel on first use) in one round trip: enqueue_messages for one.
-- Scalar arguments, bound in binary: nothing to build per call but the values themselves.
SELECT fairqueue_enqueue_one_v1(
    %(channel)b::text, %(task)b::text, %(payload)b::text::jsonb, %(priority)b::smallint,
    %(run_at)b::timestamptz, %(max_attempts)b::integer, %(keep_result)b::boolean,
    %(default_max_concurrency)b::integer, %(default_release_interval)b::interval,
    %(default_weight)b::integer, %(default_max_backlog)b::integer, %(notify_channel)b::text,
    %(delay)b::interval, %(create)b::boolean, %(unique_key)b::text, %(unique_scope)b::text,
    %(on_conflict)b::text
) AS id;
