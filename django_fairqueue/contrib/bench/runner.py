"""Run scenarios cell by cell on one database and collect a :class:`Report`."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import django
import psycopg
from django.conf import settings
from django.db import connections

import django_fairqueue
from django_fairqueue import conf
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.harness import Bench, CpuWatch, Progress
from django_fairqueue.contrib.bench.report import Report, ScenarioReport, check_targets
from django_fairqueue.contrib.bench.scenario import Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.db import functions

#: Server settings recorded with every run (the ones that move queue figures).
SERVER_SETTINGS = (
    "server_version",
    "shared_buffers",
    "work_mem",
    "maintenance_work_mem",
    "effective_cache_size",
    "synchronous_commit",
    "fsync",
    "wal_sync_method",
    "wal_level",
    "full_page_writes",
    "wal_compression",
    "wal_buffers",
    "commit_delay",
    "max_wal_size",
    "checkpoint_timeout",
    "jit",
    "max_connections",
    "autovacuum",
    "autovacuum_naptime",
    "random_page_cost",
    "io_method",
)

#: Where the package runs from: a git checkout's root, or site-packages.
PACKAGE_ROOT = Path(django_fairqueue.__file__).resolve().parent.parent
#: ``git_checkout``'s error outside a git checkout.
NOT_A_CHECKOUT = "not a git checkout"

_FUNCTION_RE = re.compile(
    r"CREATE OR REPLACE FUNCTION (\w+)\(.*?\bAS \$\$(.*?)\$\$", re.DOTALL | re.IGNORECASE
)


def run(
    scenarios: Sequence[Scenario],
    sizes: Sizes,
    *,
    using: str,
    progress: Progress | None = None,
    on_scenario: Callable[[ScenarioReport], None] | None = None,
    meta: dict[str, Any] | None = None,
    where: dict[str, str] | None = None,
) -> Report:
    """Run every cell of ``scenarios`` on database ``using`` (whose queue tables it empties).

    ``where`` keeps only the cells whose fields equal the given values (as text), e.g.
    ``{"batch": "100"}``; a cell without such a field is kept.
    """
    plans = [(s, select_cells(s.plan(sizes), where or {})) for s in scenarios]
    plans = [(s, cells) for s, cells in plans if cells]
    runnable, skipped = [], []
    for scenario, cells in plans:
        reason = scenario.unavailable(using) if scenario.unavailable is not None else None
        if reason is None:
            runnable.append((scenario, cells))
        else:
            skipped.append(f"scenario {scenario.name} skipped: {reason}")
    plans = runnable
    progress = progress or Progress(sum(len(cells) for _, cells in plans), enabled=False)
    progress.total = sum(len(cells) for _, cells in plans)
    bench = Bench(using=using, sizes=sizes, progress=progress)
    began = time.monotonic()
    report = Report(meta={**(meta or {}), **describe(using, sizes)})
    report.meta["warnings"].extend(skipped)
    watch = CpuWatch(str(report.meta["database"]["name"]))
    for message in report.meta["warnings"]:
        progress.say(f"warning: {message}")
    with queue_database(using):
        try:
            for scenario, cells in plans:
                section = ScenarioReport(scenario)
                report.scenarios[scenario.name] = section
                scenario_began = time.monotonic()
                for cell in cells:
                    progress.start(cell.label)
                    watch.start()
                    result = scenario.run(bench, cell)
                    section.others_cpu.append(watch.stop())
                    progress.done(scenario.summary(result))
                    section.results.append(result)
                if scenario.finish is not None:
                    section.results = scenario.finish(section.results)
                section.wall_seconds = time.monotonic() - scenario_began
                if on_scenario is not None:
                    on_scenario(section)
        finally:
            bench.reset()
            connections[using].close()
    report.meta["finished_at"] = _now()
    report.meta["wall_seconds"] = round(time.monotonic() - began, 1)
    report.meta["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report.targets = check_targets(report)
    return report


def select_cells(cells: Sequence[Any], where: dict[str, str]) -> list[Any]:
    return [
        cell
        for cell in cells
        if all(str(getattr(cell, k)) == v for k, v in where.items() if hasattr(cell, k))
    ]


@contextmanager
def queue_database(using: str) -> Iterator[None]:
    """Point the public API (``enqueue``, which takes no alias) at the benchmark's database."""
    if using == conf.get().DATABASE:
        yield
        return
    from django.test import override_settings  # the documented way to swap a setting

    # The queue's models follow it there (its router first), as a queue in a database of its
    # own is set up: the queue refuses a DATABASE its models are not routed to.
    routers = ["django_fairqueue.routers.QueueRouter", *getattr(settings, "DATABASE_ROUTERS", [])]
    with override_settings(
        FAIRQUEUE={**getattr(settings, "FAIRQUEUE", {}), "DATABASE": using},
        DATABASE_ROUTERS=routers,
    ):
        yield


def describe(using: str, sizes: Sizes) -> dict[str, Any]:
    """What a reader needs to trust or reproduce the figures: machine, server, code, load."""
    settings_dict = connections[using].settings_dict
    installed = db.select_function_digests(using=using)
    server = db.select_server_settings(SERVER_SETTINGS, using=using)
    warnings = []
    stale = _stale_functions(installed)
    if stale:
        warnings.append(
            f"installed function(s) {', '.join(stale)} differ from db/functions/: this "
            "database was migrated before the last edit (use --scratch for a fresh install)"
        )
    load = os.getloadavg()
    if load[0] > 1.0:
        warnings.append(f"the machine is busy (load average {load[0]:.2f}): figures will be noisy")
    connections[using].close()
    return {
        "started_at": _now(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "sizes": asdict(sizes),
        "host": {
            "cpus": os.cpu_count(),
            "memory_gib": _memory_gib(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "django": django.get_version(),
            "psycopg": psycopg.__version__,
            "django_fairqueue": django_fairqueue.__version__,
        },
        "load_average_before": [round(x, 2) for x in load],
        "database": {
            "alias": using,
            "name": settings_dict["NAME"],
            "host": settings_dict.get("HOST") or "",
            "server": server,
            "functions": installed,
            "fairqueue_settings": {
                k: str(v) for k, v in asdict(conf.get()).items() if k != "TASK_MODULES"
            },
        },
        "git": git_checkout(PACKAGE_ROOT),
        "warnings": warnings,
    }


def _stale_functions(installed: dict[str, str]) -> list[str]:
    """fairqueue functions whose installed body differs from the checked-out db/functions/."""
    wanted = {
        name: hashlib.md5(body.encode(), usedforsecurity=False).hexdigest()
        for name, body in _FUNCTION_RE.findall(functions.sql())
    }
    return sorted(name for name, digest in wanted.items() if installed.get(name) != digest)


def git_checkout(root: Path) -> dict[str, Any]:
    """The commit of the git checkout at ``root`` and its changed files under
    ``django_fairqueue/``; outside one (a source archive, an installed package), why there is
    no commit: ``{"error": "not a git checkout"}``."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", "django_fairqueue").split("\n")
    except subprocess.CalledProcessError as exc:
        said = exc.stderr.strip().splitlines() or [f"git exited with {exc.returncode}"]
        return {"error": NOT_A_CHECKOUT if "not a git repository" in exc.stderr else said[0]}
    except (OSError, subprocess.SubprocessError) as exc:  # no git, or it hung
        return {"error": f"git: {exc}"}
    return {"commit": commit, "dirty": sorted(line[3:] for line in dirty if line.strip())}


def _memory_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return round(pages / 2**30, 1)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def with_repeat(sizes: Sizes, *, duration: float | None, repeat: int | None) -> Sizes:
    """``sizes`` with the command line's ``--duration`` and ``--repeat`` applied."""
    if duration is not None:
        sizes = replace(sizes, duration=duration)
    if repeat is not None:
        sizes = replace(sizes, repeat=repeat)
    return sizes
