-- django-fairqueue: statements about the database session itself (its clock).
--
-- Each statement starts with `-- name: verb_noun` and a one-line description;
-- django_fairqueue/db/pg.py loads this file once and has exactly one function per name
-- (tests/test_store_sql.py checks both ways).
-- Parameters are psycopg named placeholders %(name)s, always bound, never formatted in.

-- name: select_clock
-- The database's clock, for figures computed against its timestamps.
SELECT clock_timestamp();
