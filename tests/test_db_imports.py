"""No module uses another module's private names.

The database layer (``django_fairqueue.db``) is one module per table family, each with its
private helpers; a caller, another family or an optional app (``contrib``, the benchmarks)
that reached into them would make every helper a public promise. So across modules only
public names are used: ``from X import _name`` and ``X._name`` fail here when ``X`` is another
module of the package (a private *module* such as ``migrations._sql`` may be imported: the
underscore there keeps it out of the public API, not out of the package).

No package is an exception: the worker's services meet through public names too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import django_fairqueue

PACKAGE = Path(django_fairqueue.__file__).parent
ROOT = PACKAGE.parent
CHECKED = sorted(
    [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")],
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of this source tree."""
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def shares_privates(user: str, owner: str) -> bool:
    """Whether module ``user`` may use the private names of module ``owner``: its own only."""
    return user == owner


def resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` in module ``here`` imports from."""
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_uses(path: Path) -> list[str]:
    """Where ``path`` uses a private name of another module of the package."""
    here = module_name(path)
    tree = ast.parse(path.read_text("utf-8"))
    found = []
    modules: dict[str, str] = {}  # local name -> the package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("django_fairqueue") and alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node, here, path.name == "__init__.py")
            if not source.startswith("django_fairqueue") or shares_privates(here, source):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if is_module(target):
                    modules[alias.asname or alias.name] = target
                elif private(alias.name):
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found.append(f"{where}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and not shares_privates(here, modules[node.value.id])
            and private(node.attr)
            and not is_module(f"{modules[node.value.id]}.{node.attr}")
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(path: Path) -> None:
    found = private_uses(path)
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_rule_catches_both_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = PACKAGE / "contrib" / "bench" / "db.py"  # a real path: module_name needs one
    source = (
        "from django_fairqueue.db import pg\n"
        "from django_fairqueue.db.pg import _new_cursor, kept_cursor\n"
        "from django_fairqueue.migrations import _sql\n"
        "pg._KEPT_CURSORS\n"
        "pg.kept_cursor\n"
        "_sql.anything\n"
    )
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: source)

    found = private_uses(module)

    assert [line.split(": ", 1)[1] for line in found] == [
        "from django_fairqueue.db.pg import _new_cursor",
        "pg._KEPT_CURSORS",
    ]


def test_the_rule_sees_the_db_package_and_the_benchmarks() -> None:
    names = {module_name(p) for p in CHECKED}
    assert {"django_fairqueue.db.pg", "django_fairqueue.db.message_store"} <= names
    assert "django_fairqueue.contrib.bench.db" in names
    assert any(n.startswith("benchmarks.") for n in names)
