"""Run the maintenance services: rescue expired leases, fold counter deltas, prune old rows.

Workers already run these on their intervals; this command is for deployments that start
workers with ``--no-maintenance``, or for a one-off pass (``--once``), for example from cron.
Running it next to workers is safe: concurrent copies never move a row twice.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any

from django.core.management.base import OutputWrapper

from django_fairqueue.maintenance import MaintenanceRunner
from django_fairqueue.runtime import StopFlag, command_logging, stop_signals
from django_fairqueue.tasks.spec import registry

logger = logging.getLogger("django_fairqueue.maintenance")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--once",
        action="store_true",
        help="Run each service once, print what it did and exit (default: run until SIGTERM).",
    )


def handle(options: dict[str, Any], stdout: OutputWrapper) -> None:
    # The tasks, as a worker imports them: the rescuer dead-letters the expired messages of
    # tasks delivered at most once now, and the scheduler fires schedules of registered tasks.
    registry.autodiscover()
    stop = StopFlag()
    runner = MaintenanceRunner(stop=stop)
    if options["once"]:
        counts = runner.run_once()
        stdout.write(", ".join(f"{name}: {count}" for name, count in counts.items()))
        return

    def on_signal(signum: int) -> None:
        stop.set()

    with command_logging(options["verbosity"]), stop_signals(on_signal):
        if threading.current_thread() is threading.main_thread():
            logger.info("maintenance running; SIGTERM or Ctrl-C stops it")
        runner.run()
