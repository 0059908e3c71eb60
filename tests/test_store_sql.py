"""The "SQL in one place" rules, enforced.

* Every statement named in a file of ``db/statements/`` has a function of the same name in the
  module of ``django_fairqueue.db`` that loads that file, and every function of such a module
  that runs a named statement runs its own; every statement file belongs to one module. The
  same holds for the benchmark app's ``contrib/bench/sql/bench.sql`` and its ``db.py``.
* No Python module of the package writes SQL of its own: the keywords of a statement appear only
  in ``db/``, the bench app's ``db.py``, ``devdb.py`` (server bootstrap) and migrations.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import django_fairqueue
from django_fairqueue import db
from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.db import message_store

PACKAGE = Path(django_fairqueue.__file__).parent
DB = PACKAGE / "db"
BENCH = PACKAGE / "contrib" / "bench"
PIPELINE = PACKAGE / "contrib" / "pipeline"
# The pipeline app's datastore.py runs the data-plane statements of its sql/pipeline.sql (user
# tables).
SQL_ALLOWED = {
    BENCH / "db.py",
    PACKAGE / "devdb.py",
    PIPELINE / "datastore.py",
}


def family_modules() -> list[ModuleType]:
    """The modules of ``django_fairqueue.db`` that run named statements (each holds its file)."""
    modules = [
        importlib.import_module(f"{db.__name__}.{info.name}")
        for info in pkgutil.iter_modules(db.__path__)
    ]
    return [m for m in modules if hasattr(m, "queries")]


def statement_file(module: ModuleType) -> Path:
    """The SQL file whose statements ``module`` runs."""
    files = module.queries
    return Path(importlib.import_module(files.package).__file__ or "").parent / files.resource


def all_statements() -> dict[str, str]:
    """Every named statement of ``db/statements/``, by name."""
    named: dict[str, str] = {}
    for module in family_modules():
        named.update(module.queries())
    return named


# Each module that runs named statements, with the SQL file of its statements.
STATEMENT_MODULES = [
    *(
        pytest.param(m, statement_file(m), id=m.__name__.rsplit(".", 1)[1])
        for m in family_modules()
    ),
    pytest.param(bench_db, BENCH / "sql" / "bench.sql", id="bench-db"),
]


def test_every_statement_file_belongs_to_one_module() -> None:
    files = [statement_file(m) for m in family_modules()]
    assert len(files) == len(set(files)), files
    assert sorted(files) == sorted((DB / "statements").glob("*.sql"))
    assert len(files) >= 9  # pg, enqueue, messages, channels, ... (the discovery works)


def _statement_name(node: ast.AST) -> ast.expr | None:
    """The name expression if ``node`` runs a named statement: ``_run(NAME, ...)``,
    ``_run_claim(NAME, ...)``, ``_run_back_to_queue(NAME, ...)`` or ``queries()[NAME]``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("_run", "_run_claim", "_run_back_to_queue")
    ):
        return node.args[0] if node.args else None
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "queries"
    ):
        return node.slice
    return None


def statement_runners(module: ModuleType) -> dict[str, set[str]]:
    """For each top-level function of ``module``: the names of the statements it runs."""
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text("utf-8"))
    runners: dict[str, set[str]] = {}
    for func in tree.body:
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            name = _statement_name(node)
            if name is None:
                continue
            if func.name.startswith("_") and not isinstance(name, ast.Constant):
                continue  # the private runner (_run) executes the statement it is given
            assert isinstance(name, ast.Constant) and isinstance(name.value, str), (
                f"{module.__name__}.{func.name} runs a statement whose name is computed"
            )
            runners.setdefault(func.name, set()).add(name.value)
    return runners


@pytest.mark.parametrize(("module", "sql_file"), STATEMENT_MODULES)
def test_every_named_statement_has_its_store_function(module: ModuleType, sql_file: Path) -> None:
    runners = statement_runners(module)
    missing = sorted(name for name in module.queries() if name not in runners)
    assert not missing, f"{sql_file.name} names without a function running them: {missing}"
    for name in module.queries():
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name} is not a function"


@pytest.mark.parametrize(("module", "sql_file"), STATEMENT_MODULES)
def test_every_store_function_runs_the_statement_of_its_own_name(
    module: ModuleType, sql_file: Path
) -> None:
    named = set(module.queries())
    for function, statements in statement_runners(module).items():
        assert statements == {function}, (
            f"{module.__name__}.{function} runs {sorted(statements)}; a function of the db "
            "package runs exactly the statement of its own name"
        )
        assert function in named, (
            f"{module.__name__}.{function} runs a statement {sql_file.name} lacks"
        )


@pytest.mark.parametrize(("module", "sql_file"), STATEMENT_MODULES)
def test_every_statement_has_a_description(module: ModuleType, sql_file: Path) -> None:
    text = sql_file.read_text("utf-8")
    for name, body in module.queries().items():
        assert re.match(r"-- \S", body), f"{name}: the line after `-- name:` must describe it"
        code = [line for line in body.splitlines() if line.strip() and not line.startswith("--")]
        assert code and code[-1].rstrip().endswith(";"), f"{name}: a statement ends with `;`"
    assert len(re.findall(r"^-- name: ", text, re.MULTILINE)) == len(module.queries())


# Every name of the queue's or of the catalog's in a statement, and whether a call follows it:
# a prepared statement may name only functions (fairqueue_..._vN, pg_...), called. A table or
# a view, however it is named (FROM, a comma join, INSERT INTO, USING, schema-qualified or
# quoted), is a name without a call.
QUEUE_NAME = re.compile(r"\b((?:fairqueue|pg)_\w+)\b\"?(\s*\()?", re.I)
SERVER_FUNCTION = re.compile(r"fairqueue_\w+_v\d+", re.I)


def tables_read(statement: str) -> list[str]:
    """The queue's tables (or any name but a server function's call) ``statement`` names."""
    code = "\n".join(line.split("--")[0] for line in statement.splitlines())
    return [
        name
        for name, call in QUEUE_NAME.findall(code)
        if not (call and (SERVER_FUNCTION.fullmatch(name) or name.lower().startswith("pg_")))
    ]


@pytest.mark.parametrize(("module", "sql_file"), STATEMENT_MODULES)
def test_only_calls_of_server_functions_are_prepared(module: ModuleType, sql_file: Path) -> None:
    """A prepared statement keeps a plan made from the table sizes of its first runs: only a
    statement naming no table may be prepared (pg.named_statements)."""
    for name in module.queries.prepared():
        tables = tables_read(module.queries()[name])
        assert not tables, f"{sql_file.name}: {name} is prepared and reads {sorted(set(tables))}"


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1 FROM fairqueue_message m WHERE m.id = 1",
        "SELECT 1 FROM unnest(%(ids)s) x, fairqueue_message m",
        "INSERT INTO fairqueue_channel_delta (channel_id) VALUES (1)",
        "DELETE FROM fairqueue_message m USING fairqueue_channel c WHERE m.channel_id = c.id",
        'SELECT 1 FROM public."fairqueue_message"',
        "SELECT fairqueue_claim_v1(1) FROM fairqueue_channel",
        "SELECT count(*) FROM pg_stat_activity",
    ],
)
def test_the_rule_sees_a_table_however_it_is_named(statement: str) -> None:
    assert tables_read(statement)


def test_the_prepared_statements_are_the_hot_calls() -> None:
    """The claim, the completion and the enqueue are prepared and name no table; a statement
    reading the message table is not prepared."""
    prepared = {n for m in family_modules() for n in m.queries.prepared()}
    assert {"claim_messages", "complete_messages", "enqueue_message"} <= prepared
    assert "heartbeat_messages" not in prepared
    assert tables_read(message_store.queries()["claim_messages"]) == []
    assert tables_read("SELECT pg_notify(%(channel)s, ''), fairqueue_next_due_v1(1)") == []
    assert tables_read(message_store.queries()["heartbeat_messages"])


def test_a_statement_name_belongs_to_one_file() -> None:
    seen: dict[str, str] = {}
    for module in [*family_modules(), bench_db]:
        for name in module.queries():
            assert name not in seen, f"{name} is named by {seen[name]} and {module.__name__}"
            seen[name] = module.__name__


def python_files() -> list[Path]:
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if path not in SQL_ALLOWED
        and not path.is_relative_to(DB)
        and "migrations" not in path.relative_to(PACKAGE).parts
    )


# Statement shapes in upper case (the project writes SQL keywords in capitals), rather than
# bare keywords, so prose such as "INSERT ... SELECT generate_series" or "Do not LISTEN for
# wake-ups" in a help text passes while any real statement is caught.
SQL_SHAPES = re.compile(
    r"\bSELECT\s.*\bFROM\s|\bSELECT\s+\w+\s*\(|\bUPDATE\s+\w+\s.*\bSET\s"
    r"|\bINSERT\s+INTO\s+\w|\bDELETE\s+FROM\s+\w|\b(?:TRUNCATE|ANALYZE)\s+fairqueue_",
    re.DOTALL,
)


def sql_strings(path: Path, root: Path = PACKAGE) -> list[str]:
    """String literals of a module that look like SQL statements (docstrings excepted)."""
    tree = ast.parse(path.read_text("utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        f"{path.relative_to(root)}:{node.lineno}: {node.value.strip()[:80]!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and SQL_SHAPES.search(node.value)
    ]


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_sql_outside_the_db_package(path: Path) -> None:
    found = sql_strings(path)
    assert not found, "SQL outside django_fairqueue/db (name it in db/statements/):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    ("text", "is_sql"),
    [
        ("SELECT id FROM fairqueue_message", True),
        ("SELECT pg_notify('fairqueue', '')", True),
        ("UPDATE fairqueue_channel SET paused = true", True),
        ("INSERT INTO fairqueue_message (id) VALUES (1)", True),
        ("DELETE FROM fairqueue_channel_delta", True),
        ("TRUNCATE fairqueue_message", True),
        ("ANALYZE fairqueue_message", True),
        ("bulk-load (INSERT ... SELECT generate_series, fold, ANALYZE)", False),
        ("Select the channels from the list to update", False),
        ("Do not LISTEN for wake-ups; poll only", False),
        ("Press UPDATE to save", False),
    ],
)
def test_the_sql_detector(text: str, is_sql: bool) -> None:
    assert bool(SQL_SHAPES.search(text)) is is_sql


def test_the_rule_flags_string_literals_not_docstrings_or_comments(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        '"""Runs SELECT id FROM fairqueue_message, in the docstring."""\n'
        "# UPDATE fairqueue_channel SET paused = true (a comment)\n"
        "def f(cur):\n"
        '    """DELETE FROM fairqueue_message (a docstring)."""\n'
        '    cur.execute(f"DELETE FROM fairqueue_message WHERE id = {1}")\n'
        "    cur.execute('SELECT 1 ' 'FROM fairqueue_channel')\n"
    )

    found = sql_strings(module, tmp_path)

    assert sorted(line.split(":")[1] for line in found) == ["5", "6"]


def test_the_rule_sees_the_package() -> None:
    files = {p.relative_to(PACKAGE).as_posix() for p in python_files()}
    assert {"api.py", "models/channels.py", "tasks/__init__.py", "conf.py"} <= files
    assert not any(f.startswith("migrations/") for f in files)
    assert not any(f.startswith("db/") for f in files)
    assert "contrib/bench/harness.py" in files
    assert "contrib/bench/db.py" not in files
