"""``runfairworker --pipelines``: pipeline batches in a thread of the worker process.

Registered by the app's ``ready()`` as a companion of the worker
(:mod:`django_fairqueue.worker.extensions`); PySpark is imported only when the option is given.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django_fairqueue.worker.extensions import Companion, WorkerExtension

if TYPE_CHECKING:
    from django.core.management.base import CommandParser

    from django_fairqueue.contrib.pipeline.runner import PipelineRunner, RunnerGroup
    from django_fairqueue.worker.config import WorkerConfig


class RunnerThread(Companion):
    """A :class:`PipelineRunner` (or a :class:`RunnerGroup` of them) running in a thread
    next to the worker's."""

    def __init__(self, runner: PipelineRunner | RunnerGroup) -> None:
        self.runner = runner
        self.thread = threading.Thread(target=runner.run_logged, name="fairqueue-pipeline-runner")
        runner.thread = self.thread

    def stop(self) -> None:
        self.runner.stop()  # cancels a running Spark job and gives its batch back
        self.thread.join()

    def finish(self) -> None:
        # In burst mode the runner ends once no batch is ready; a signal still interrupts.
        while self.thread.is_alive():
            self.thread.join(0.5)


class PipelineExtension(WorkerExtension):
    name = "pipelines"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--pipelines",
            nargs="?",
            const="",
            metavar="NAMES",
            help="Also run Spark pipeline batches (one at a time, see --pipeline-runners) in "
            "a thread: the named pipelines (comma-separated) or, without NAMES, every "
            "registered one. "
            "Needs the spark extra (docs/howto/spark-pipeline.md).",
        )
        parser.add_argument(
            "--pipeline-runners",
            type=int,
            default=1,
            metavar="N",
            help="With --pipelines: run N batches at a time, in threads sharing the Spark "
            "session (default 1).",
        )

    def child_flags(self, options: Mapping[str, Any]) -> list[str]:
        names = options.get("pipelines")
        if names is None:
            return []
        runners = options.get("pipeline_runners") or 1
        extra = ["--pipeline-runners", str(runners)] if runners != 1 else []
        return (["--pipelines", names] if names else ["--pipelines"]) + extra

    def start(self, options: Mapping[str, Any], config: WorkerConfig) -> Companion | None:
        runners = options.get("pipeline_runners", 1)
        if options.get("pipelines") is None:
            if runners != 1:
                raise ValueError("--pipeline-runners needs --pipelines")
            return None
        from django_fairqueue.contrib.pipeline.runner import MAX_RUNNERS

        if not isinstance(runners, int) or not 1 <= runners <= MAX_RUNNERS:
            raise ValueError(f"--pipeline-runners must be from 1 to {MAX_RUNNERS}")
        raw = options["pipelines"]
        names = [n.strip() for n in raw.split(",")] if raw.strip() else []
        if "" in names:
            raise ValueError(f"--pipelines: an empty pipeline name in {raw!r}")
        from django_fairqueue.contrib.pipeline.spark import (
            SparkUnavailable,
            require_java,
            require_pyspark,
        )

        try:
            require_pyspark()
            require_java()
            from django_fairqueue.contrib.pipeline.runner import RunnerGroup, job_patterns

            job_patterns(names)  # an unknown pipeline name fails here, not in the thread
            runner = RunnerGroup(
                runners,
                worker_id=config.worker_id,
                pipelines=names or None,
                channels=config.channels or None,
                lease=config.lease,
                poll_interval=config.poll_interval,
                burst=config.burst,
            )
        except (SparkUnavailable, LookupError, ValueError) as exc:
            raise ValueError(f"--pipelines: {exc}") from None
        companion = RunnerThread(runner)
        companion.thread.start()
        return companion
