"""The optional apps (``django_fairqueue.contrib``: the benchmark, the Spark pipeline) stay
optional.

The queue imports nothing from them: no module outside ``contrib/`` names them in an import,
and a project without them in ``INSTALLED_APPS`` never loads them, whatever it uses of the
queue (worker, admin, API, commands).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.management import get_commands

import django_fairqueue

PACKAGE = Path(django_fairqueue.__file__).parent
ROOT = PACKAGE.parent
CONTRIB = "django_fairqueue.contrib"


def core_modules() -> list[Path]:
    """Every Python file of the package outside ``contrib/``."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "contrib" not in p.relative_to(PACKAGE).parts)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = ROOT) -> list[str]:
    """Modules ``path`` imports (relative imports resolved), and string constants that name a
    module of the package (``import_module("django_fairqueue.x")``, settings, task paths)."""
    tree = ast.parse(path.read_text("utf-8"))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("django_fairqueue.")
        ):
            names.append(node.value)
    return names


def test_the_queue_imports_nothing_from_contrib() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in core_modules()
        for name in imported_names(path)
        if name == CONTRIB or name.startswith(CONTRIB + ".")
    ]
    assert found == [], "the queue imports an optional app:\n" + "\n".join(found)


def test_the_rule_sees_imports_of_every_kind(tmp_path: Path) -> None:
    # A stand-in module at django_fairqueue/cli/x.py, to resolve its relative imports.
    path = tmp_path / "django_fairqueue" / "cli" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text(
        "import django_fairqueue.contrib.bench.db\n"
        "from django_fairqueue.contrib.bench import runner\n"
        "from ..contrib import bench\n"
        "from .. import contrib\n"
        "import_module('django_fairqueue.contrib.bench.plots')\n"
    )
    names = [
        n for n in imported_names(path, tmp_path) if n == CONTRIB or n.startswith(CONTRIB + ".")
    ]
    assert names == [
        "django_fairqueue.contrib.bench.db",
        "django_fairqueue.contrib.bench",
        "django_fairqueue.contrib.bench.runner",
        "django_fairqueue.contrib",
        "django_fairqueue.contrib.bench",
        "django_fairqueue.contrib",
        "django_fairqueue.contrib.bench.plots",
    ]


def test_the_rule_sees_the_package() -> None:
    files = {p.relative_to(PACKAGE).as_posix() for p in core_modules()}
    assert {
        "worker/core.py",
        "admin/channels.py",
        "db/message_store.py",
        "management/commands/fairqueue.py",
    } <= files
    assert not any(f.startswith("contrib/") for f in files)


# Sets Django up with the apps named in argv[2] (the queue, maybe an optional app), imports the
# modules named in argv[1], and prints what got loaded: modules of django_fairqueue.contrib,
# whether PySpark was imported, the commands, and runfairworker's options.
PROBE = """
import importlib, json, sys
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=[
        "django.contrib.contenttypes", "django.contrib.auth", "django.contrib.sessions",
        "django.contrib.messages", "django.contrib.admin", "django.contrib.staticfiles",
        *json.loads(sys.argv[2]),
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "unused"}},
    USE_TZ=True,
)
django.setup()
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from django.contrib import admin
from django.core.management import get_commands, load_command_class
admin.autodiscover()
commands = get_commands()
parser = load_command_class("django_fairqueue", "runfairworker").create_parser("manage.py", "x")
options = sorted(o for a in parser._actions for o in a.option_strings)
fairpipeline = None
if "fairpipeline" in commands:
    fairpipeline = commands["fairpipeline"]
    load_command_class(fairpipeline, "fairpipeline").create_parser("manage.py", "fairpipeline")
print(json.dumps({
    "contrib": sorted(m for m in sys.modules if m.startswith("django_fairqueue.contrib")),
    "pyspark": sorted(m for m in sys.modules if m.split(".")[0] in ("pyspark", "pyarrow")),
    "fairbench": "fairbench" in commands,
    "fairpipeline": fairpipeline,
    "runfairworker": options,
    "imported": len([m for m in sys.modules if m.startswith("django_fairqueue.")]),
}))
"""


def probe(modules: list[str], apps: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(modules), json.dumps(apps)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return found


def test_a_project_without_the_optional_apps_never_loads_them() -> None:
    modules = [
        module_name(p) for p in core_modules() if "migrations" not in p.relative_to(PACKAGE).parts
    ]
    found = probe(modules, ["django_fairqueue"])
    assert found["contrib"] == []
    assert found["pyspark"] == []
    # The commands and options come with the apps.
    assert found["fairbench"] is False
    assert found["fairpipeline"] is None
    assert "--concurrency" in found["runfairworker"]
    assert "--pipelines" not in found["runfairworker"]
    assert found["imported"] >= 30  # the probe did import the queue


def test_the_pipeline_app_installs_without_pyspark_imported() -> None:
    """Installing the app (models, admin, checks, the worker's option, the command) imports
    neither PySpark nor pyarrow: a project without the spark extra still starts; only running
    batches needs them."""
    found = probe([], ["django_fairqueue", "django_fairqueue.contrib.pipeline"])
    assert found["fairpipeline"] == "django_fairqueue.contrib.pipeline"
    assert "--pipelines" in found["runfairworker"]
    assert "django_fairqueue.contrib.pipeline.models" in found["contrib"]
    assert found["pyspark"] == []


def test_the_installed_optional_apps_bring_their_commands() -> None:
    # tests/settings.py installs both.
    assert get_commands()["fairbench"] == "django_fairqueue.contrib.bench"
    assert get_commands()["fairpipeline"] == "django_fairqueue.contrib.pipeline"


@pytest.mark.django_db
def test_the_pipeline_job_table_is_created_again_when_a_project_dropped_it() -> None:
    """The how-to lets a project that never used the pipeline drop the table the queue's
    migrations left; installing the app later must still migrate."""
    from importlib import import_module

    from django.db import connection
    from django.db.migrations.loader import MigrationLoader

    initial = import_module("django_fairqueue.contrib.pipeline.migrations.0001_initial")
    state = MigrationLoader(connection).project_state(("fairqueue_pipeline", "0001_initial"))
    with connection.cursor() as cursor:  # (the test's transaction)
        cursor.execute("DROP TABLE fairqueue_pipeline_job CASCADE")
    for _ in range(2):  # created, then left as it is
        with connection.schema_editor() as editor:
            initial.create_table_if_missing(state.apps, editor)
        assert "fairqueue_pipeline_job" in connection.introspection.table_names()
