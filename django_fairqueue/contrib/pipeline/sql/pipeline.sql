-- django-fairqueue: every statement the Spark pipeline runs against user tables (data plane).
--
-- Each template starts with `-- name: verb_noun` and a one-line description; only the
-- pipeline app's datastore.py loads and runs them. Identifiers ({table}, {columns}, ...) are
-- filled with psycopg.sql.Identifier, never with text; values are psycopg named
-- placeholders %(name)s, always bound (COPY statements are bound client-side by psycopg).
-- Queue statements (work batches) live in the queue's db/statements/work_batches.sql, run through
-- django_fairqueue.db.batch_store,
-- except lock_batch_for_write: the fence Spark tasks run themselves, without Django (see there).

-- name: column_types
-- The columns of a table, in order: name, PostgreSQL type name, precision and scale of numerics,
-- the length of varchar(n) and char(n), NOT NULL.
SELECT a.attname::text,
       t.typname::text,
       CASE WHEN t.typname = 'numeric' AND a.atttypmod >= 4
            THEN ((a.atttypmod - 4) >> 16) & 65535 END AS numeric_precision,
       CASE WHEN t.typname = 'numeric' AND a.atttypmod >= 4
            THEN (a.atttypmod - 4) & 65535 END AS numeric_scale,
       CASE WHEN t.typname IN ('varchar', 'bpchar') AND a.atttypmod >= 4
            THEN a.atttypmod - 4 END AS max_length,
       a.attnotnull
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass(%(table)s) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum;

-- name: read_range
-- One sub-range of a batch's ids, as CSV (read by Spark tasks into Arrow).
COPY (SELECT {columns} FROM {table} WHERE {id} BETWEEN %(lo)s AND %(hi)s)
TO STDOUT (FORMAT csv);

-- name: read_range_of_tenant
-- One sub-range of a batch's ids, only the tenant's rows, as CSV.
COPY (SELECT {columns} FROM {table} WHERE {id} BETWEEN %(lo)s AND %(hi)s AND {tenant} = %(tenant)s)
TO STDOUT (FORMAT csv);

-- name: create_staging
-- An empty UNLOGGED staging table with the sink's columns (and their types) and a partition number.
CREATE UNLOGGED TABLE {staging} AS
SELECT 0::integer AS fq_part, {columns} FROM {sink} WITH NO DATA;

-- name: clear_staging_part
-- Remove what an earlier attempt of a Spark task wrote for this partition.
DELETE FROM {staging} WHERE fq_part = %(part)s;

-- name: copy_into_staging
-- Rows computed by one Spark task, as CSV.
COPY {staging} (fq_part, {columns}) FROM STDIN (FORMAT csv);

-- name: merge_staging
-- Upsert the staged rows into the sink; rows already equal are left alone (a re-run writes nothing).
INSERT INTO {sink} ({columns})
SELECT {columns} FROM {staging}
ON CONFLICT ({key}) DO UPDATE SET ({updated}) = ROW({excluded})
WHERE ({sink_updated}) IS DISTINCT FROM ({excluded});

-- name: insert_staging
-- The staged rows into a sink that has none of their keys yet (checked with sink_has_keys in the
-- same transaction, or tried under a savepoint that a unique-key conflict rolls back to the
-- upsert): a plain INSERT, without ON CONFLICT's per-row speculative insertion. A key already
-- in the sink makes it fail on the unique key, never duplicate.
INSERT INTO {sink} ({columns})
SELECT {columns} FROM {staging};

-- name: sink_has_keys
-- Whether the sink already has a row whose (single, integer) key is in lo..hi.
SELECT EXISTS (SELECT FROM {sink} WHERE {key} BETWEEN %(lo)s AND %(hi)s);

-- name: merge_staging_keys_only
-- Insert the staged keys missing from a sink that has no other column.
INSERT INTO {sink} ({columns})
SELECT {columns} FROM {staging}
ON CONFLICT ({key}) DO NOTHING;

-- name: read_range_changed
-- One sub-range of a batch's ids, only rows changed since the last successful run ({since} is a
-- literal composed on the driver), as CSV.
COPY (SELECT {columns} FROM {table}
      WHERE {id} BETWEEN %(lo)s AND %(hi)s AND {changed} > {since})
TO STDOUT (FORMAT csv);

-- name: read_range_of_tenant_changed
-- The same, only the tenant's rows.
COPY (SELECT {columns} FROM {table}
      WHERE {id} BETWEEN %(lo)s AND %(hi)s AND {tenant} = %(tenant)s AND {changed} > {since})
TO STDOUT (FORMAT csv);

-- name: select_watermark
-- The highest value of the changed column over the tenant's rows (NULL: no row), as text.
SELECT max({changed})::text FROM {table} WHERE {tenant_filter};

-- name: select_changed_exists
-- Whether a row of the tenant changed since the given value ({since}: a literal).
SELECT EXISTS (SELECT FROM {table} WHERE {tenant_filter} AND {changed} > {since});

-- name: select_changed_windows
-- The ids of the rows changed since the given value ({since}: a literal), in windows of
-- %(size)s rows: first id, last id and rows of each (the batches of a recompute).
SELECT min(c.id), max(c.id), count(*)
FROM (SELECT {id} AS id, (row_number() OVER (ORDER BY {id}) - 1) / %(size)s AS w
      FROM {table} WHERE {tenant_filter} AND {changed} > {since}) AS c
GROUP BY c.w
ORDER BY c.w;

-- name: analyze_staging
-- Statistics for the long sink's merge (a fresh staging table has none).
ANALYZE {staging};

-- name: delete_long_stale
-- A long sink's rows of the staged source rows (marker rows: rule NULL) whose rule was not
-- staged again (a rule removed, a value now blank or an error): afterwards the sink holds for
-- those rows exactly what the batch computed.
DELETE FROM {sink} AS s
USING {staging} AS m
WHERE m.{rule} IS NULL AND s.{id} = m.{id}
  AND NOT EXISTS (SELECT FROM {staging} AS x WHERE x.{id} = s.{id} AND x.{rule} = s.{rule});

-- name: merge_long_staging
-- Upsert the staged rule rows into the long sink; rows already equal are left alone.
INSERT INTO {sink} ({columns})
SELECT {columns} FROM {staging} WHERE {rule} IS NOT NULL
ON CONFLICT ({key}) DO UPDATE SET ({updated}) = ROW({excluded})
WHERE ({sink_updated}) IS DISTINCT FROM ({excluded});

-- name: count_long_staged_rows
-- The source rows a long sink's batch computed (its marker rows).
SELECT count(*) FROM {staging} WHERE {rule} IS NULL;

-- name: lock_batch_for_write
-- Queue SQL kept here on purpose: the first statement of a Spark task's transaction when the sink
-- is not atomic. Spark executors have no Django (so no django_fairqueue.db); this is their
-- fence. It takes a share lock on the batch row under the lease token: while the task's
-- transaction is open the rescuer (FOR UPDATE SKIP LOCKED) cannot take the batch away, and once
-- the batch was rescued or settled no row comes back and the task writes nothing. Heartbeats
-- (UPDATE) wait for the task's commit; the lease cannot expire into a rescue meanwhile.
SELECT 1
FROM fairqueue_work_batch b
WHERE b.id = %(batch)s::bigint AND b.lease_token = %(token)s::uuid AND b.state = 'running'
FOR SHARE;

-- name: create_task_staging
-- A Spark task's private staging table (its own session, dropped at commit), for rows whose keys
-- the sink may already have.
CREATE TEMPORARY TABLE {staging} ON COMMIT DROP AS
SELECT {columns} FROM {sink} WITH NO DATA;

-- name: copy_rows
-- Rows computed by one Spark task into a table (the sink or the task's staging table), as CSV.
COPY {table} ({columns}) FROM STDIN (FORMAT csv);

-- name: drop_staging
-- Drop a staging table (if it is still there).
DROP TABLE IF EXISTS {staging};

-- name: staging_tables
-- The pipeline's staging tables in the current schema.
SELECT c.relname::text
FROM pg_class c
WHERE c.relname LIKE 'fq\_stage\_%%' AND c.relkind = 'r'
  AND c.relnamespace = current_schema()::regnamespace
ORDER BY 1;

-- name: insert_with_sql
-- The formulas computed by PostgreSQL alone into a sink without these keys (the benchmark's
-- baseline: its sink starts empty, so no ON CONFLICT work per row).
INSERT INTO {sink} ({columns})
SELECT {expressions} FROM {table} WHERE {id} BETWEEN %(lo)s AND %(hi)s {tenant_filter};

-- name: tenant_filter
-- The condition that limits the baseline to one tenant's rows.
AND {tenant} = %(tenant)s

-- name: range_of_ids
-- Smallest and largest id of a table (the benchmark's one-batch range).
SELECT min({id}), max({id}), count(*) FROM {table};

-- name: sink_checksum
-- Rows and the sum of one numeric column of a table (the benchmark compares its two results).
SELECT count(*), coalesce(sum({column}), 0)::double precision FROM {table};

-- name: results_checksum
-- The sum of one numeric key of the jsonb results column (the benchmark compares its results).
SELECT coalesce(sum(({column} ->> %(name)s)::double precision), 0) FROM {table};

-- name: truncate_table
-- Empty a table (the benchmark's sink between runs).
TRUNCATE {table};

-- name: create_bench_source
-- The benchmark's scratch source table (seed 002's data objects).
CREATE UNLOGGED TABLE {table} (
    id bigint PRIMARY KEY,
    tenant text NOT NULL,
    price double precision NOT NULL,
    qty integer NOT NULL,
    discount double precision NOT NULL,
    tax_rate double precision NOT NULL,
    -- a marketing table's columns, for the realistic rules (channel, spend, clicks have blanks)
    channel text,
    region text NOT NULL,
    spend double precision,
    clicks integer,
    impressions integer NOT NULL,
    first_on date NOT NULL,
    last_on date NOT NULL
);

-- name: create_bench_sink
-- The benchmark's scratch sink table: typed columns and a jsonb column for the other rules.
CREATE UNLOGGED TABLE {table} (
    id bigint PRIMARY KEY,
    tenant text NOT NULL,
    subtotal double precision,
    total double precision,
    band text,
    results jsonb
);

-- name: index_bench_source
-- The (tenant, id) index the how-to asks of a source read per tenant (plans and reads use it).
CREATE INDEX ON {table} (tenant, id);

-- name: fill_bench_source
-- Generate rows lo..hi (of 1..rows) of the benchmark's source for the tenants %(tenants)s: each
-- id's tenant picked by a hash of the id, so tenants' rows interleave as in a table filled by
-- all of them at once; with %(contiguous)s, each tenant owns one run of ids instead.
INSERT INTO {table} (id, tenant, price, qty, discount, tax_rate, channel, region, spend, clicks,
                     impressions, first_on, last_on)
SELECT g,
       (%(tenants)s::text[])[1 + CASE
           WHEN %(contiguous)s THEN (g - 1) * cardinality(%(tenants)s::text[]) / %(rows)s
           ELSE (g * 2654435761 %% 4294967291) %% cardinality(%(tenants)s::text[]) END],
       round((1 + (g * 7919 %% 100000) / 100.0)::numeric, 2)::double precision,
       1 + g %% 17,
       (g %% 5) * 0.05,
       CASE WHEN g %% 3 = 0 THEN 0.2 ELSE 0.07 END,
       (ARRAY[NULL, 'Email', 'Email', 'Search', 'Search', 'Social', 'Social'])[1 + g %% 7],
       (ARRAY['north', 'south', 'east', 'west'])[1 + (g / 3) %% 4],
       CASE WHEN g %% 11 = 0 THEN NULL
            ELSE round(((g * 104729 %% 50000) / 37.0)::numeric, 2)::double precision END,
       CASE WHEN g %% 13 = 0 THEN NULL ELSE (g * 31 %% 400)::integer END,
       CASE WHEN g %% 9 = 0 THEN 0 ELSE (100 + g * 17 %% 9000)::integer END,
       DATE '2024-01-01' + (g * 37 %% 700)::integer,
       DATE '2024-01-01' + (g * 37 %% 700)::integer + (g %% 90)::integer
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g;

-- name: backend_pid
-- This session's server process id (the benchmark finds the server's processes from it).
SELECT pg_backend_pid();

-- name: vacuum_analyze_table
-- Refresh the planner's statistics and the visibility map of a freshly filled table (so the
-- planning walk is index-only, as on a settled table). Runs outside a transaction block.
VACUUM (ANALYZE) {table};

-- name: lookup_rows
-- A lookup table's rows, one per key (of a key's rows, the one whose columns sort first), at
-- most %(limit)s.
SELECT DISTINCT ON ({key}) {columns} FROM {table}
WHERE {key} IS NOT NULL
ORDER BY {key}, {columns}
LIMIT %(limit)s;

-- name: lookup_rows_of_tenant
-- The tenant's rows of a lookup table, one per key, at most %(limit)s.
SELECT DISTINCT ON ({key}) {columns} FROM {table}
WHERE {key} IS NOT NULL AND {tenant} = %(tenant)s
ORDER BY {key}, {columns}
LIMIT %(limit)s;
