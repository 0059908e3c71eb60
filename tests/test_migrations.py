"""Migrations carry their change, never a copy; every path through them ends at the same schema.

A new database runs the squashed initial migration; one that ran some of 0001-0027 runs the
rest of those. Both end with the same tables, indexes, constraints and triggers, and with
exactly the live server functions (``db/functions/``). A migration that replaces functions
leaves exactly one callable version of each.
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.state import ProjectState

import django_fairqueue
import django_fairqueue.migrations as fairqueue_migrations
from django_fairqueue import api, batches
from django_fairqueue.db import functions as server_functions
from django_fairqueue.db import message_store
from django_fairqueue.migrations._sql import InstallFunctions
from django_fairqueue.models import Channel, ChannelGroup, Schedule
from tests import fairtasks

claim_wait = importlib.import_module("django_fairqueue.migrations.0004_claim_wait")
claim_cpu = importlib.import_module("django_fairqueue.migrations.0033_claim_cpu")

APP = "fairqueue"
SQUASHED = "0001_squashed_0027_worker_queues"
MIGRATIONS_DIR = Path(fairqueue_migrations.__file__).parent
PACKAGE_DIR = Path(django_fairqueue.__file__).parent
CREATE_FUNCTION_RE = re.compile(
    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(?:\w+\.)?(\w+)", re.IGNORECASE
)
#: The migrations hold their changes only (about 2,500 lines with the replaced 0001-0027). The
#: headroom is for the migrations to come, and smaller than the claim's or the enqueue's family
#: file: a copy of either would not fit (a copy of any family fails the name check anyway).
MIGRATION_LINES_MAX = 2_800

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
        # As before 0004 ran: the old claim only.
        for signature in signatures("fairqueue_claim_v1"):
            cur.execute(f"DROP FUNCTION fairqueue_claim_v1({signature})")
        cur.execute(OLD_CLAIM)
    state = ProjectState()
    with connection.schema_editor() as editor:
        for operation in claim_wait.Migration.operations:
            operation.database_forwards(APP, editor, state, state)

    (claim,) = signatures("fairqueue_claim_v1")
    assert "p_maintain boolean, p_wait_ms integer" in claim, claim
    with connection.cursor() as cur:
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
    assert claim.endswith("p_async_except text[], p_slow_start boolean, p_token uuid"), claim
    (plan,) = signatures("fairqueue_plan_grouped_v1")
    assert "p_queue text, p_slow_start boolean, OUT" in plan, plan
    (fold,) = signatures("fairqueue_fold_deltas_v1")
    assert fold.endswith("p_by_time boolean, p_drained boolean"), fold
    (complete,) = signatures("fairqueue_complete_v1")
    assert complete.endswith("p_runs double precision[], p_async_commit boolean"), complete
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
        # and those of the release before the commits without the WAL wait (0032)
        cur.execute(
            "SELECT count(*) FROM fairqueue_claim_v1(1, interval '1 minute', 'old-worker', "
            "NULL, NULL, NULL, true, 0, false, NULL)"
        )
        assert cur.fetchone() == (0,)
        cur.execute("SELECT count(*) FROM fairqueue_complete_v1('{}', '{}', '{}', '{}')")
        assert cur.fetchone() == (0,)
        cur.execute("SELECT current_setting('synchronous_commit')")
        assert cur.fetchone() == ("on",)


# --- Every path ends at the same schema and the live functions ----------------------------------

#: kind -> (how many leading columns name an object, the query)
SCHEMA_QUERIES = {
    # column order is left out: a column added by a later migration comes last in an upgraded
    # table, where the squashed migration may create it elsewhere
    "columns": (
        2,
        """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attgenerated, a.attidentity
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE starts_with(c.relname, 'fairqueue') AND c.relkind = 'r'
          AND a.attnum > 0 AND NOT a.attisdropped""",
    ),
    "storage": (
        1,
        """
        SELECT relname, reloptions FROM pg_class
        WHERE starts_with(relname, 'fairqueue') AND relkind = 'r'""",
    ),
    "constraints": (
        2,
        """
        SELECT c.relname, k.conname, pg_get_constraintdef(k.oid), k.convalidated
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        WHERE starts_with(c.relname, 'fairqueue')""",
    ),
    "indexes": (
        1,
        """
        SELECT indexname, indexdef FROM pg_indexes WHERE starts_with(tablename, 'fairqueue')""",
    ),
    "triggers": (1, "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal"),
    "functions": (
        1,
        """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p
        WHERE starts_with(p.proname, 'fairqueue_')""",
    ),
}


def schema() -> dict[str, dict[str, str]]:
    """What the queue's tables and functions are, per kind: {identity: definition}."""
    found = {}
    with connection.cursor() as cur:
        for kind, (keys, query) in SCHEMA_QUERIES.items():
            cur.execute(query)
            found[kind] = {
                " ".join(map(str, row[:keys])): "\n".join(map(str, row[keys:]))
                for row in cur.fetchall()
            }
    return found


def installed_functions() -> dict[str, str]:
    return schema()["functions"]


def live_functions() -> dict[str, str]:
    """The functions of the live db/functions/ files, installed alone (rolled back afterwards)."""
    with transaction.atomic(), connection.cursor() as cur:
        for signature in installed_functions():
            cur.execute(f"DROP FUNCTION {signature} CASCADE")  # and the trigger using it
        cur.execute(server_functions.sql())
        functions = installed_functions()
        transaction.set_rollback(True)
    return functions


def differences(got: dict[str, str], want: dict[str, str]) -> str:
    """What a reader needs to see where two sets of definitions differ (empty if they do not)."""
    lines = [f"missing: {s}" for s in sorted(want.keys() - got.keys())]
    lines += [f"unexpected: {s}" for s in sorted(got.keys() - want.keys())]
    for key in sorted(want.keys() & got.keys()):
        if got[key] != want[key]:
            diff = difflib.unified_diff(
                want[key].splitlines(), got[key].splitlines(), "want", "got", n=1, lineterm=""
            )
            lines += [f"differs: {key}", *list(diff)[:40]]
    return "\n".join(lines)


def replaced_chain() -> MigrationExecutor:
    """An executor that sees 0001-0027 one by one, not their squash: it builds a database as a
    release before the squash left it (partway through them)."""
    executor = MigrationExecutor(connection)
    executor.loader = MigrationLoader(connection, replace_migrations=False)
    return executor


def migrate_all() -> None:
    """Every app to its latest migration, as ``manage.py migrate`` does."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def squashed_recorded() -> bool:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM django_migrations WHERE app = %s AND name = %s", [APP, SQUASHED]
        )
        return cur.fetchone() == (1,)


def migrate_app_to_zero() -> None:
    MigrationExecutor(connection).migrate([(APP, None)])


@pytest.mark.django_db(transaction=True)
def test_every_path_through_the_migrations_ends_at_one_schema_with_the_live_functions() -> None:
    want_functions = live_functions()
    assert {"fairqueue_claim_v1", "fairqueue_claim_batch_v1"} <= {
        s.split("(")[0] for s in want_functions
    }
    hint = (
        "\n\nA migrated database's functions differ from the live db/functions/ files: after "
        "editing one, add a migration that installs its family (django_fairqueue/migrations/"
        "_sql.py, InstallFunctions)."
    )
    # (the migrations the squash replaces: later ones follow it on every path)
    squash = replaced_chain().loader.disk_migrations[(APP, SQUASHED)]
    replaced = sorted(name for app, name in squash.replaces if app == APP)
    assert replaced[0] == "0001_initial" and replaced[-1] == "0027_worker_queues"
    try:
        # A new database: the squashed migration alone.
        migrate_app_to_zero()
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_proc WHERE starts_with(proname, 'fairqueue_')")
            assert cur.fetchone() == (0,), "unapplying the migrations leaves functions behind"
        migrate_all()
        fresh = schema()
        assert not differences(fresh["functions"], want_functions), (
            differences(fresh["functions"], want_functions) + hint
        )
        # A database at each step of 0001-0027 (0027 itself: the chain as a release before
        # the squash ran it), upgraded.
        for step in replaced:
            migrate_app_to_zero()
            replaced_chain().migrate([(APP, step)])
            migrate_all()
            got = schema()
            for kind in SCHEMA_QUERIES:
                found = differences(got[kind], fresh[kind])
                assert not found, f"{step} -> latest: {kind} differ from a new database's\n{found}"
            assert squashed_recorded(), f"{step}: the squashed migration is not recorded"
    finally:
        # Later tests share the database: leave every app fully migrated.
        migrate_all()


#: The delta table's `drained` (migration 0044), as its model declares it.
LEND_DRAINED = (
    "ALTER TABLE fairqueue_channel_delta ADD COLUMN drained boolean NOT NULL DEFAULT false"
)


def fill_every_kind_of_row() -> None:
    """Messages in every state, a group, a queue, unique holds, schedules and work batches."""
    ChannelGroup.objects.create(name="acme", weight=2, max_concurrency=5)
    for i in range(4):
        fairtasks.add.enqueue(i, i, channel="alpha")
        fairtasks.add.enqueue(i, i, channel=("acme", f"user{i}"))
    fairtasks.add.enqueue(1, 1, channel="beta", queue="reports")
    fairtasks.add.enqueue(1, 1, channel="alpha", run_after=timedelta(hours=2))
    cancelled = fairtasks.add.enqueue(2, 2, channel="alpha", run_after=timedelta(hours=2))
    for key in ("k1", "k2"):
        fairtasks.add.enqueue(3, 3, channel="gamma", unique_key=key, unique_scope="active")
    claimed = message_store.claim_messages(
        9, lease=timedelta(hours=1), worker_id="before-the-squash"
    )
    assert len(claimed) == 9
    done, retried, failed, aborted, released, *_ = claimed
    message_store.complete_messages([(done.id, done.lease_token, 2)])  # kept result: succeeded
    error = {"type": "ValueError", "message": "no"}
    message_store.fail_messages([(retried.id, retried.lease_token, error, timedelta(minutes=5))])
    message_store.fail_messages([(failed.id, failed.lease_token, error, None)])
    api.abort([aborted.id])
    message_store.release_messages([(aborted.id, aborted.lease_token)])  # its worker stopped it
    message_store.release_messages([(released.id, released.lease_token)])
    api.cancel([cancelled])
    channel = Channel.objects.get(name="alpha")
    Schedule.objects.create(
        name="nightly", task_name="tests.fair.add", cron="0 3 * * *", channel=channel
    )
    batches.plan("job", channel="alpha", table="fairqueue_channel", id_column="id", batch_size=2)
    batch = batches.claim(worker_id="before-the-squash")
    assert batch is not None
    with batches.fenced(batch) as fence:
        fence.rows_processed = 2
    assert batches.claim(worker_id="before-the-squash") is not None  # left running


def every_row(columns: dict[str, set[str]] | None = None) -> dict[str, list[str]]:
    """Every row of every fairqueue table as JSON; with ``columns``, only those tables, each row
    cut to those columns (what a migration after the rows were written cannot have changed:
    the columns it adds are new, and checked on their own)."""
    rows = {}
    with connection.cursor() as cur:
        cur.execute(
            "SELECT relname FROM pg_class WHERE starts_with(relname, 'fairqueue') AND relkind = 'r'"
        )
        for (table,) in cur.fetchall():
            if columns is not None and table not in columns:
                continue
            cur.execute(f"SELECT to_jsonb(x) FROM {table} x")
            found = [row[0] if isinstance(row[0], dict) else json.loads(row[0]) for row in cur]
            if columns is not None:
                found = [{k: v for k, v in row.items() if k in columns[table]} for row in found]
            rows[table] = sorted(json.dumps(row, sort_keys=True) for row in found)
    return rows


def columns_of(rows: dict[str, list[str]]) -> dict[str, set[str]]:
    """The columns of each table of ``every_row()``'s answer (a table without rows: none)."""
    return {
        table: set().union(*(json.loads(row) for row in found)) if found else set()
        for table, found in rows.items()
    }


@pytest.mark.django_db(transaction=True)
def test_a_database_at_0027_with_rows_of_every_kind_upgrades_with_nothing_lost() -> None:
    try:
        migrate_app_to_zero()
        replaced_chain().migrate([(APP, "0027_worker_queues")])
        # The live functions, which write these rows, read columns later migrations add:
        # lent to the schema of 0027 while they write, taken back before the upgrade.
        with connection.cursor() as cur:
            cur.execute(claim_cpu.ADD_COLUMN)
            cur.execute(LEND_DRAINED)
        fill_every_kind_of_row()
        with connection.cursor() as cur:
            cur.execute("ALTER TABLE fairqueue_channel DROP COLUMN claimable")
            cur.execute("ALTER TABLE fairqueue_channel_delta DROP COLUMN drained")
        before = every_row()
        with connection.cursor() as cur:
            cur.execute("SELECT DISTINCT state FROM fairqueue_message")
            states = {row[0] for row in cur.fetchall()}
        assert states == {
            "scheduled",
            "ready",
            "running",
            "succeeded",
            "failed",
            "cancelled",
            "aborted",
        }
        assert before["fairqueue_unique_hold"] and before["fairqueue_schedule"]
        migrate_all()
        # the rows as they were, in the columns they had (later migrations add columns)
        assert every_row(columns_of(before)) == before
        assert squashed_recorded(), "0001-0027 ran, yet the squashed migration is not recorded"
        # and the queue goes on: the ready messages are claimed, the counters agree
        claimed = message_store.claim_messages(50, lease=timedelta(minutes=1), worker_id="after")
        assert len(claimed) == sum('"state": "ready"' in r for r in before["fairqueue_message"])
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM fairqueue_verify_channels_v1(NULL)")
            assert cur.fetchone() == (0,)
    finally:
        migrate_all()


# --- Migrations carry their change, not a copy --------------------------------------------------


def migration_files() -> list[Path]:
    return sorted(
        p for p in MIGRATIONS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )


def live_function_names() -> set[str]:
    return {name.lower() for name in CREATE_FUNCTION_RE.findall(server_functions.sql())}


def test_no_migration_carries_a_copy_of_a_function() -> None:
    files = migration_files()
    assert MIGRATIONS_DIR / f"{SQUASHED}.py" in files
    # Function text lives in db/functions/ only: no data file beside the migrations ...
    assert [p.name for p in files if p.suffix != ".py"] == []
    # ... and no migration module defines a server function (InstallFunctions installs them).
    live = live_function_names()
    for path in files:
        defined = {n.lower() for n in CREATE_FUNCTION_RE.findall(path.read_text("utf-8"))}
        assert not defined & live, f"{path.name} carries a copy of {sorted(defined & live)}"
        assert len(defined) <= 1, f"{path.name} defines functions {sorted(defined)}"
    lines = sum(len(p.read_text("utf-8").splitlines()) for p in files)
    assert lines <= MIGRATION_LINES_MAX, (
        f"the migrations hold {lines} lines: does one carry a copy instead of its change?"
    )


def test_the_copy_check_catches_a_copy() -> None:
    """The check above, on a migration that carries a family file: it must find it."""
    copy = f'SQL = """\n{server_functions.sql("settle")}"""\n'
    defined = {n.lower() for n in CREATE_FUNCTION_RE.findall(copy)}
    assert {"fairqueue_complete_v1", "fairqueue_run_seconds_v1"} <= defined & live_function_names()


def test_every_migration_installs_functions_through_install_functions() -> None:
    loader = MigrationLoader(None, ignore_no_migrations=True, replace_migrations=False)
    installers = {
        name
        for (app, name), migration in loader.disk_migrations.items()
        if app == APP and any(isinstance(op, InstallFunctions) for op in migration.operations)
    }
    assert {SQUASHED, "0002_functions_v1", "0003_work_batch_claim"} <= installers
    squashed = loader.disk_migrations[(APP, SQUASHED)]
    (install,) = [op for op in squashed.operations if isinstance(op, InstallFunctions)]
    assert install.families == server_functions.FAMILIES
    with pytest.raises(ValueError, match="unknown function families"):
        InstallFunctions("claims")


def test_the_wheel_carries_no_copy_of_a_function_file() -> None:
    """pyproject's package data (what the wheel ships beside the modules): the only .sql files
    with server functions in it are the families' files."""
    pyproject = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text("utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["django_fairqueue"]
    shipped = {p for pattern in patterns for p in PACKAGE_DIR.glob(pattern) if p.is_file()}
    family_files = {
        PACKAGE_DIR / "db" / "functions" / f"{name}.sql"
        for f in server_functions.FAMILIES
        for name in server_functions.files(f)
    }
    assert family_files <= shipped
    live = live_function_names()
    with_functions = {
        p
        for p in shipped
        if p.suffix == ".sql"
        and {n.lower() for n in CREATE_FUNCTION_RE.findall(p.read_text("utf-8"))} & live
    }
    assert with_functions == family_files
    assert not any("migrations" in p.relative_to(PACKAGE_DIR).parts for p in shipped)
