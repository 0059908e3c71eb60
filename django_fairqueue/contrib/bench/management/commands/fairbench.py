"""``manage.py fairbench``: measure the queue on this database (see docs/performance.md)."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from argparse import ArgumentParser
from pathlib import Path
from typing import Any, TextIO, cast

from django.core.management.base import CommandError

from django_fairqueue import conf
from django_fairqueue.contrib.bench.database import benchmark_database
from django_fairqueue.contrib.bench.report import ScenarioReport, table, targets_table
from django_fairqueue.contrib.bench.runner import run, select_cells, with_repeat
from django_fairqueue.contrib.bench.scenarios import (
    PRESETS,
    SCENARIOS,
    BenchmarkError,
    Progress,
    Scenario,
    Sizes,
    plots,
)
from django_fairqueue.management.base import FairCommand
from django_fairqueue.runtime import stop_signals


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT during a run, raised where the run is: every block on the way out
    cleans up as for Ctrl-C (workers stopped, the scratch database dropped), and psycopg
    cancels a running query on a KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int) -> None:
    raise Stopped(signum)


def _stopped_within(exc: BaseException) -> Stopped | None:
    """The Stopped an error was raised in the handling of, if any: a signal that lands inside
    Django's COMMIT leaves the connection in its transaction, and the atomic block's way out
    then fails on that instead of passing the Stopped on."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, Stopped):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class Command(FairCommand):
    help = (
        "Benchmark django-fairqueue on this database: enqueue rate, claim+complete throughput, "
        "claim latency, fairness, and (through real runfairworker processes) end-to-end "
        "throughput and pickup latency. Refuses a database whose queue tables hold rows, unless "
        "--scratch (a separate database on the same server, created and dropped by the run)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--scenario",
            action="append",
            choices=list(SCENARIOS),
            dest="scenarios",
            metavar="NAME",
            help=f"run only this scenario (repeatable; default all): {', '.join(SCENARIOS)}",
        )
        parser.add_argument(
            "--quick",
            action="store_const",
            const="quick",
            dest="sizes",
            default="full",  # argparse takes the default of the first action of a dest
            help="smaller sizes (same as --sizes quick): every scenario still takes about 12 "
            "minutes on 2 cores; with one --scenario it is the quick smoke test",
        )
        parser.add_argument(
            "--sizes",
            choices=list(PRESETS),
            default="full",
            help="size preset: full (default), quick, or tiny (tests only; figures meaningless)",
        )
        parser.add_argument(
            "--duration", type=float, help="seconds per throughput cell (full: 5, quick: 1.5)"
        )
        parser.add_argument(
            "--repeat",
            type=int,
            help="run each throughput cell N times and report the median (default 1)",
        )
        parser.add_argument(
            "--where",
            action="append",
            default=[],
            metavar="FIELD=VALUE",
            help="run only the cells whose FIELD is VALUE, e.g. --where batch=100 --where "
            "channels=100 (repeatable; cells without FIELD are kept)",
        )
        parser.add_argument(
            "--messages",
            type=int,
            help="admin scenario: messages in the queue whose pages are timed "
            "(full: 1,000,000, quick: 200,000)",
        )
        parser.add_argument(
            "--channels",
            type=int,
            help="admin scenario: channels those messages spread over (default 10,000)",
        )
        parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
        parser.add_argument(
            "--plots",
            metavar="DIR",
            help="also draw PNG plots of the scenarios run into DIR (needs matplotlib, the "
            f"`plots` extra): {plots.E2E_FILE} (e2e throughput vs processes x threads), "
            f"{plots.FAIRNESS_FILE} (B's wait vs A's backlog) and {plots.TIMESHARE_FILE} "
            "(timeshare: Jain's index by count and by time, small tenants' p99 wait), "
            "e.g. --plots docs/img",
        )
        parser.add_argument(
            "--baseline",
            metavar="PATH",
            help="an earlier run's --json file: tables add each cell's main figure then, and the "
            "change",
        )
        parser.add_argument(
            "--database",
            help="database alias to benchmark (default FAIRQUEUE['DATABASE'])",
        )
        parser.add_argument(
            "--scratch",
            action="store_true",
            help="run in a fresh database <name>_fairbench on the same server, dropped afterwards",
        )
        parser.add_argument(
            "--keep-scratch",
            action="store_true",
            help="with --scratch: keep the scratch database (its queue tables emptied)",
        )
        parser.add_argument(
            "--no-progress", action="store_true", help="no progress lines on stderr"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run; a stop signal ends the run cleaned up, with one line and 128 + its number."""
        try:
            with stop_signals(_raise_stopped):
                self._handle(options)
        except KeyboardInterrupt as exc:  # Stopped, or Ctrl-C before the handlers were set
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            self._stopped(signum)
        except Exception as exc:
            stopped = _stopped_within(exc)
            if stopped is None:
                raise
            self._stopped(stopped.signum)

    def _stopped(self, signum: int) -> None:
        self.stderr.write(f"fairbench: run stopped by {signal.Signals(signum).name}")
        raise SystemExit(128 + signum) from None

    def _handle(self, options: dict[str, Any]) -> None:
        if options["duration"] is not None and options["duration"] <= 0:
            raise CommandError("--duration must be positive")
        if options["repeat"] is not None and options["repeat"] < 1:
            raise CommandError("--repeat must be at least 1")
        if options["keep_scratch"] and not options["scratch"]:
            raise CommandError("--keep-scratch needs --scratch")
        for name in ("messages", "channels"):
            if options[name] is not None and options[name] < 1:
                raise CommandError(f"--{name} must be at least 1")
        sizes = with_repeat(
            PRESETS[options["sizes"]], duration=options["duration"], repeat=options["repeat"]
        )
        if options["messages"] is not None:
            sizes = dataclasses.replace(sizes, admin_messages=options["messages"])
        if options["channels"] is not None:
            sizes = dataclasses.replace(sizes, admin_channels=options["channels"])
        names = options["scenarios"] or list(SCENARIOS)
        scenarios = [SCENARIOS[name] for name in SCENARIOS if name in names]
        alias = options["database"] or conf.get().DATABASE
        json_path = Path(options["json"]) if options["json"] else None
        plots_dir = Path(options["plots"]) if options["plots"] else None
        if plots_dir is not None:
            try:  # before the run, not after minutes of it
                plots.pyplot()
            except BenchmarkError as exc:
                raise CommandError(str(exc)) from exc
        where = self._where(options["where"], scenarios, sizes)
        baseline = None
        if options["baseline"]:
            try:
                baseline = json.loads(Path(options["baseline"]).read_text())
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot read --baseline {options['baseline']}: {exc}") from exc

        # The stream under Django's OutputWrapper, which would end every \r-redrawn line.
        stream = cast(TextIO, getattr(self.stderr, "_out", sys.stderr))
        progress = Progress(0, stream, enabled=not options["no_progress"])

        def show(section: ScenarioReport) -> None:
            self.stdout.write("\n" + table(section, baseline) + "\n")

        try:
            with benchmark_database(
                alias,
                scratch=options["scratch"],
                keep_scratch=options["keep_scratch"],
                say=progress.say,
            ) as using:
                report = run(
                    scenarios,
                    sizes,
                    using=using,
                    progress=progress,
                    on_scenario=show,
                    meta={"scratch": options["scratch"]},
                    where=where,
                )
        except BenchmarkError as exc:
            raise CommandError(str(exc)) from exc
        if report.targets:
            self.stdout.write("\n" + targets_table(report.targets) + "\n")
        meta = report.meta
        self.stdout.write(
            f"\n{meta['wall_seconds']:.0f}s on {meta['database']['name']} "
            f"(PostgreSQL {meta['database']['server'].get('server_version', '?')}, "
            f"{meta['host']['cpus']} CPUs, load {meta['load_average_before'][0]:.2f} before, "
            f"{meta['load_average_after'][0]:.2f} after)\n"
        )
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report.as_json(), indent=1) + "\n")
            self.stdout.write(f"results written to {json_path}\n")
        if plots_dir is not None:
            results = {name: s.results for name, s in report.scenarios.items()}
            for path in plots.write_plots(results, plots_dir):
                self.stdout.write(f"plot written to {path}\n")

    @staticmethod
    def _where(terms: list[str], scenarios: list[Scenario], sizes: Sizes) -> dict[str, str]:
        where: dict[str, str] = {}
        for term in terms:
            name, sep, value = term.partition("=")
            if not sep or not name.strip():
                raise CommandError(f"--where takes FIELD=VALUE, got {term!r}")
            where[name.strip()] = value.strip()
        cells = [cell for s in scenarios for cell in s.plan(sizes)]
        fields = {f.name for cell in cells for f in dataclasses.fields(cell)}
        unknown = sorted(set(where) - fields)
        if unknown:
            raise CommandError(
                f"--where: no cell has field(s) {', '.join(unknown)}; fields: "
                f"{', '.join(sorted(fields))}"
            )
        if where and not any(select_cells(s.plan(sizes), where) for s in scenarios):
            raise CommandError("--where selects no cell")
        return where
