-- django-fairqueue: statements about the database session and server (its clock, what holds its xmin horizon).
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/pg.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: select_clock
-- The database's clock, for figures computed against its timestamps.
SELECT clock_timestamp();

-- name: select_isolation_level
-- The isolation level of the transaction open on this connection ("read committed", ...).
SELECT current_setting('transaction_isolation');

-- name: select_xmin_holders
-- What holds this database's xmin horizon back, oldest snapshot first: sessions whose transaction began more than `min_age` ago and holds a snapshot or an xid, prepared transactions older than that, and replication slots holding an xmin with no consumer connected.
-- VACUUM keeps every row version such a holder may still see, so under one the queue's hot
-- tables and indexes fill with dead versions the claim walks past. Sessions and prepared
-- transactions of other databases do not hold this database's horizon (PostgreSQL 14 and
-- later); slots hold every database's. Autovacuum's own snapshot is ignored by other vacuums,
-- so it is not listed. A role without pg_read_all_stats sees other roles' sessions without
-- their start, state and query (NULL), but with their xmin: those are listed once they hold
-- the horizon `min_xid_age` transactions back, with no age.
SELECT h.kind, h.pid, h.name, h.age_seconds, h.xid_age, h.state, h.query
FROM (
    SELECT 'transaction'::text AS kind, a.pid,
           coalesce(nullif(a.application_name, ''), a.usename::text, '') AS name,
           extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS age_seconds,
           age(coalesce(a.backend_xmin, a.backend_xid))::bigint AS xid_age,
           coalesce(a.state, '') AS state,
           -- (a hidden session's reads "<insufficient privilege>")
           CASE WHEN a.xact_start IS NOT NULL THEN left(a.query, 200) END AS query
    FROM pg_stat_activity a
    WHERE a.datname = current_database()
      AND a.pid <> pg_backend_pid()
      -- (hidden, as the start and the query are, from a role without pg_read_all_stats)
      AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
      AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
      AND (a.xact_start < clock_timestamp() - %(min_age)s::interval
           OR (a.xact_start IS NULL  -- another role's, hidden from this one
               AND age(coalesce(a.backend_xmin, a.backend_xid)) >= %(min_xid_age)s::integer))
    UNION ALL
    SELECT 'prepared', NULL, p.gid,
           extract(epoch FROM clock_timestamp() - p.prepared)::float8,
           age(p.transaction)::bigint, 'prepared', NULL
    FROM pg_prepared_xacts p
    WHERE p.database = current_database()
      AND p.prepared < clock_timestamp() - %(min_age)s::interval
    UNION ALL
    -- a slot has no start time; its xmin's age in transactions says how far back it holds
    SELECT 'slot', s.active_pid, s.slot_name::text, NULL,
           greatest(age(s.xmin), age(s.catalog_xmin))::bigint,
           CASE WHEN s.xmin IS NULL THEN 'inactive, catalog only' ELSE 'inactive' END, NULL
    FROM pg_replication_slots s
    WHERE NOT s.active AND (s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL)
) h
ORDER BY h.xid_age DESC NULLS LAST, h.age_seconds DESC NULLS LAST
LIMIT %(limit)s::integer;
