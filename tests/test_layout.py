"""The package laid out by concern: a short top level, sub-packages that ship, every module
importable, and the benchmarks' own arithmetic in the benchmark app."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import django_fairqueue

PACKAGE = Path(django_fairqueue.__file__).parent
#: the most modules the package's top level holds; the rest live in named sub-packages
TOP_LEVEL_MAX = 25


def test_the_top_level_holds_at_most_25_modules() -> None:
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MAX, modules


def test_every_directory_of_modules_is_a_regular_package() -> None:
    """setuptools ships only packages with an ``__init__.py`` (``packages.find``): a directory
    of modules without one would be missing from the wheel."""
    missing = [
        str(d.relative_to(PACKAGE))
        for d in PACKAGE.rglob("*")
        if d.is_dir()
        and d.name != "__pycache__"
        and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    ]
    assert missing == []


def test_every_module_imports() -> None:
    """A module moved without its importers updated fails here, not in a user's project."""
    failed = {}
    for info in pkgutil.walk_packages(django_fairqueue.__path__, "django_fairqueue."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:  # pragma: no cover - the assertion below shows it
            failed[info.name] = repr(exc)
    assert failed == {}


def test_the_benchmarks_arithmetic_lives_in_the_benchmark_app() -> None:
    """Percentiles and Jain's index for benchmark reports are lab code: the optional benchmark
    app has them, the queue does not ship them."""
    assert not (PACKAGE / "figures.py").exists()
    figures = importlib.import_module("django_fairqueue.contrib.bench.figures")
    assert figures.jain_index([1.0, 1.0]) == 1.0
