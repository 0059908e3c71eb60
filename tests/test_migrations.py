"""Migrations install server-side functions from frozen copies, and end with exactly the live ones.

A migration that replaces functions leaves exactly one callable version of each.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
from django.db import connection, migrations, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

import django_fairqueue.migrations as fairqueue_migrations
from django_fairqueue import store
from django_fairqueue.migrations._sql import migration_sql

functions_v1 = importlib.import_module("django_fairqueue.migrations.0002_functions_v1")
claim_wait = importlib.import_module("django_fairqueue.migrations.0004_claim_wait")
fairness_by_time = importlib.import_module("django_fairqueue.migrations.0013_fairness_by_time")
queues = importlib.import_module("django_fairqueue.migrations.0024_queues")

# fairqueue_claim_v1 as migration 0002 installed it before 0004 (no p_wait_ms); the body does
# not matter to the migration, only the signature.
OLD_CLAIM = """
CREATE FUNCTION fairqueue_claim_v1(
    p_limit integer, p_lease interval, p_worker text, p_only bigint[] DEFAULT NULL,
    p_exclude bigint[] DEFAULT NULL, p_quantum integer DEFAULT NULL,
    p_maintain boolean DEFAULT true
) RETURNS SETOF bigint LANGUAGE sql AS $$ SELECT 1::bigint WHERE false $$;
"""


def signatures(name: str) -> list[str]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_get_function_identity_arguments(oid) FROM pg_proc WHERE proname = %s",
            [name],
        )
        return [row[0] for row in cur.fetchall()]


@pytest.mark.django_db
def test_0004_replaces_the_old_claim_signature_and_old_calls_still_work() -> None:
    with connection.cursor() as cur:
        # As before 0004 ran: the old claim only. (0002's reverse drops every signature; 0013's
        # drops those it added.)
        cur.execute(functions_v1.DROP_V1)
        cur.execute(fairness_by_time.DROP_NEW)
        cur.execute(queues.DROP_NEW)
        assert signatures("fairqueue_claim_v1") == []
        cur.execute(OLD_CLAIM)

        (operation,) = claim_wait.Migration.operations
        cur.execute(operation.sql)

        (claim,) = signatures("fairqueue_claim_v1")
        assert claim.endswith("p_maintain boolean, p_wait_ms integer"), claim
        (combined,) = signatures("fairqueue_complete_and_claim_v1")
        assert combined.endswith("p_quantum integer, p_wait_ms integer"), combined
        # A caller still passing the old arguments (a worker of the previous release during a
        # rolling deploy) resolves to the new function, which then never waits.
        cur.execute(
            "SELECT count(*) FROM fairqueue_claim_v1(1, interval '1 minute', 'old-worker', "
            "NULL, NULL, NULL, true)"
        )
        assert cur.fetchone() == (0,)


@pytest.mark.django_db
def test_0013_leaves_one_signature_each_and_old_calls_still_work() -> None:
    """Callers of the previous release (a rolling deploy) reach the new functions, which then
    behave as before: fairness by count, no run time recorded."""
    (claim,) = signatures("fairqueue_claim_v1")
    assert claim.endswith("p_wait_ms integer, p_by_time boolean, p_queues text[]"), claim
    (fold,) = signatures("fairqueue_fold_deltas_v1")
    assert fold.endswith("p_by_time boolean"), fold
    (complete,) = signatures("fairqueue_complete_v1")
    assert complete.endswith("p_runs double precision[]"), complete
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM fairqueue_claim_v1(1, interval '1 minute', 'old-worker', "
            "NULL, NULL, NULL, true, 0)"
        )
        assert cur.fetchone() == (0,)
        cur.execute("SELECT fairqueue_fold_deltas_v1(10, false)")
        assert cur.fetchone() == (0,)
        cur.execute("SELECT count(*) FROM fairqueue_complete_v1('{}', '{}', '{}')")
        assert cur.fetchone() == (0,)


# --- Every migration installs a frozen copy of its SQL ------------------------------------------
#
# Migrations read migrations/sql/<name>.sql (django_fairqueue/migrations/_sql.py), never the live
# sql/*.sql files. The live files are what the code calls, so a fully migrated database must
# have exactly their functions: an edit of a live file needs a new migration with its own copy.

APP = "fairqueue"
FROZEN_DIR = Path(fairqueue_migrations.__file__).parent / "sql"
CREATE_FUNCTION_RE = re.compile(r"\bCREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\b", re.IGNORECASE)


def installed_functions() -> dict[str, str]:
    """Signature -> pg_get_functiondef of every function whose name starts with fairqueue_."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p "
            "WHERE starts_with(p.proname, 'fairqueue_') ORDER BY 1"
        )
        return dict(cur.fetchall())


def live_functions() -> dict[str, str]:
    """The functions of the live sql/ files, installed alone (rolled back afterwards)."""
    with transaction.atomic(), connection.cursor() as cur:
        for signature in installed_functions():
            cur.execute(f"DROP FUNCTION {signature} CASCADE")  # and the trigger using it
        cur.execute(store.functions_sql(1))
        cur.execute(store.functions_sql(1, part="batches"))
        cur.execute(store.functions_sql(1, part="schedules"))
        functions = installed_functions()
        transaction.set_rollback(True)
    return functions


def app_migrations() -> list[str]:
    """Names of the app's migrations, in the order they apply."""
    graph = MigrationLoader(connection).graph
    (leaf,) = graph.leaf_nodes(APP)
    return [name for app, name in graph.forwards_plan(leaf) if app == APP]


def migrate(name: str | None) -> None:
    """Migrate the app forwards or backwards to migration ``name`` (None: unapplied)."""
    MigrationExecutor(connection).migrate([(APP, name)])


def differences(got: dict[str, str], want: dict[str, str]) -> str:
    """What a reader needs to see where two sets of functions differ (empty if they do not)."""
    lines = [f"missing: {s}" for s in sorted(want.keys() - got.keys())]
    lines += [f"unexpected: {s}" for s in sorted(got.keys() - want.keys())]
    for signature in sorted(want.keys() & got.keys()):
        if got[signature] != want[signature]:
            diff = difflib.unified_diff(
                want[signature].splitlines(),
                got[signature].splitlines(),
                "live",
                "migrated",
                n=1,
                lineterm="",
            )
            lines += [f"differs: {signature}", *list(diff)[:40]]
    return "\n".join(lines)


@pytest.mark.django_db(transaction=True)
def test_migrating_from_zero_or_any_step_installs_exactly_the_live_functions() -> None:
    want = live_functions()
    assert {"fairqueue_claim_v1", "fairqueue_claim_batch_v1"} <= {s.split("(")[0] for s in want}
    names = app_migrations()
    latest = names[-1]
    hint = (
        "\n\nA migrated database's functions differ from the live sql/ files: after editing "
        "sql/functions_v1.sql or sql/functions_batches_v1.sql, add a migration that installs a "
        "copy of the edited file (django_fairqueue/migrations/_sql.py)."
    )
    try:
        for step in [None, *names[:-1]]:
            # A database at this step, upgraded: one migrated back to it (the reverses that do
            # not drop functions leave newer ones behind), and one migrated up to it from zero.
            for from_zero in (False, True):
                if from_zero:
                    migrate(None)
                migrate(step)
                migrate(latest)
                found = differences(installed_functions(), want)
                how = "up from zero" if from_zero else "back from the latest"
                assert not found, f"{step or 'zero'} ({how}) -> {latest}:\n{found}{hint}"
    finally:
        # Later tests share the database: leave every app fully migrated.
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


def test_each_migration_installs_functions_from_its_own_frozen_copy() -> None:
    # A migration's copies: migrations/sql/<name>.sql, or <name>.<part>.sql when it installs
    # several files (say <name>.sql and <name>.batches.sql).
    copies: dict[str, list[str]] = {}
    for path in sorted(FROZEN_DIR.glob("*.sql")):
        copies.setdefault(path.stem.split(".")[0], []).append(path.stem)
    loader = MigrationLoader(None, ignore_no_migrations=True)
    installers: set[str] = set()
    for (app, name), migration in loader.disk_migrations.items():
        if app != APP:
            continue
        source = inspect.getsource(sys.modules[type(migration).__module__])
        # store.functions_sql reads the live files, which change with the code.
        assert "functions_sql" not in source, name
        sql = ""
        for operation in migration.operations:
            if isinstance(operation, migrations.RunSQL):
                statements = [operation.sql] if isinstance(operation.sql, str) else operation.sql
                sql += "\n".join(s if isinstance(s, str) else s[0] for s in statements)
        if not CREATE_FUNCTION_RE.search(sql):
            continue
        installers.add(name)
        assert copies.get(name), f"{name} creates functions but has no migrations/sql/{name}.sql"
        for copy in copies[name]:
            text = migration_sql(copy)
            assert text in sql, f"{name} does not run its copy {copy}.sql whole"
            sql = sql.replace(text, "")
        assert not CREATE_FUNCTION_RE.search(sql), f"{name} creates functions outside its copies"
    assert {"0002_functions_v1", "0003_work_batch_claim"} <= installers
    # Every copy belongs to a migration that installs it (a misnamed copy would not be run).
    assert set(copies) == installers
