"""Planning pipeline jobs and running their batches: claim -> heartbeat -> Spark -> fenced.

One :class:`PipelineRunner` per process runs one batch at a time on the process's SparkSession
(a batch already uses every core Spark has). ``manage.py fairpipeline run`` runs it in the
foreground; ``manage.py runfairworker --pipelines`` runs it in a thread next to the message
threads.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connections

from django_fairqueue import batches, conf
from django_fairqueue._runtime import StopFlag
from django_fairqueue.exceptions import LeaseLost
from django_fairqueue.pipeline.core import Pipeline, UnknownPipeline, registry
from django_fairqueue.pipeline.execute import (
    BatchOutcome,
    PipelineError,
    checked,
    drop_orphaned_staging,
    execute_batch,
    prepare,
)
from django_fairqueue.pipeline.formulas import FormulaError

logger = logging.getLogger("django_fairqueue.pipeline")

#: How often a runner drops orphaned staging tables and rescues expired batches.
MAINTENANCE_INTERVAL = 30.0


def plan(
    name: str,
    *,
    tenants: Sequence[str] | None = None,
    batch_size: int | None = None,
    spark: Any = None,
    progress: bool | Callable[[int, float], None] = False,
) -> list[batches.PlanResult]:
    """Validate every tenant's formulas, then plan one job per tenant (``pipeline:tenant``).

    Nothing is planned if any tenant's formula is invalid (:class:`FormulaError` names the
    tenant and the formula). With ``spark`` (a SparkSession), Spark's analyzer checks the
    formulas too. Planning again adds only batches for rows appended since.
    """
    pipeline = registry.get(name)
    chosen = list(tenants) if tenants is not None else pipeline.tenant_names()
    if not chosen:
        raise PipelineError(f"pipeline {name!r} has no tenants to plan")
    prepared = [prepare(pipeline, tenant) for tenant in chosen]
    if spark is not None:
        for one in prepared:
            checked.ensure(spark, one)  # remembered: the batches' runs do not check again
    return [
        batches.plan(
            pipeline.job_name(tenant),
            channel=tenant,
            table=pipeline.source.table_name,
            id_column=pipeline.source.id_column,
            batch_size=batch_size or pipeline.batch_size,
            max_attempts=pipeline.max_attempts,
            filters={pipeline.source.tenant_column: tenant}
            if pipeline.source.tenant_column
            else None,
            progress=progress,
            using=pipeline.alias,
        )
        for tenant in chosen
    ]


def job_patterns(names: Sequence[str] | None) -> list[str]:
    """Claim patterns for these pipelines (all registered ones if None)."""
    chosen = list(names) if names else registry.names()
    for name in chosen:
        registry.get(name)  # UnknownPipeline for a typo
    return [f"{name}:*" for name in chosen]


@dataclass
class RunnerStats:
    succeeded: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    rows: int = 0


class PipelineRunner:
    """Claim pipeline batches fairly across tenants and run them until stopped.

    ``stop()`` (from another thread or a signal handler) makes the watcher thread cancel the
    running Spark job; its batch is given back (``batches.release``: no attempt used).
    """

    def __init__(
        self,
        *,
        worker_id: str,
        pipelines: Sequence[str] | None = None,
        channels: Sequence[str] | None = None,
        lease: timedelta | None = None,
        poll_interval: float | None = None,
        burst: bool = False,
        max_batches: int | None = None,
        spark: Any = None,
        on_batch: Callable[[BatchOutcome], None] | None = None,
    ) -> None:
        cfg = conf.get()
        self.worker_id = worker_id
        self.pipelines = list(pipelines) if pipelines else None
        self.channels = list(channels) if channels else None
        self.lease = lease or timedelta(seconds=cfg.LEASE_SECONDS)
        self.poll_interval = poll_interval if poll_interval is not None else cfg.POLL_INTERVAL
        self.burst = burst
        self.max_batches = max_batches
        self.spark = spark
        self.on_batch = on_batch
        self.stats = RunnerStats()
        self.stopping = StopFlag()  # safe to set from a signal handler
        self._tag = f"fairqueue-{uuid.uuid4().hex[:12]}"
        self._next_maintenance = 0.0
        self._finished = threading.Event()
        #: The thread running :meth:`run_logged`, when a worker runs the runner next to it.
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        self.stopping.set()  # the watcher thread cancels the Spark job (no py4j call here)

    def _cancel(self) -> None:
        if self.spark is not None:
            try:
                self.spark.sparkContext.cancelJobsWithTag(self._tag)
            except Exception as exc:  # the session may be stopping already
                logger.debug("cancelling Spark jobs failed: %s", exc)

    def _aliases(self) -> set[str]:
        names = self.pipelines or registry.names()
        return {registry.get(name).alias for name in names} or {conf.get().DATABASE}

    def maintain(self) -> None:
        """Return expired batches to the queue; drop orphaned staging tables."""
        for alias in self._aliases():
            rescued = batches.rescue_expired(using=alias)
            if rescued:
                logger.info("rescued %d work batches whose lease expired", len(rescued))
            dropped = drop_orphaned_staging(alias)
            if dropped:
                logger.info("dropped %d orphaned staging tables", len(dropped))

    def run(self) -> RunnerStats:
        from django_fairqueue.pipeline.spark import get_session

        patterns = job_patterns(self.pipelines)
        if self.spark is None:
            self.spark = get_session()
        done = 0
        try:
            while not self.stopping.is_set():
                if time.monotonic() >= self._next_maintenance:
                    self.maintain()
                    self._next_maintenance = time.monotonic() + MAINTENANCE_INTERVAL
                batch = batches.claim(
                    worker_id=self.worker_id,
                    jobs=patterns,
                    lease=self.lease,
                    channels=self.channels,
                )
                if batch is None:
                    if self.burst:
                        break
                    self.stopping.wait(self.poll_interval)
                    continue
                self.process(batch)
                done += 1
                if self.max_batches is not None and done >= self.max_batches:
                    break
        finally:
            for alias in connections:
                connections[alias].close()
        return self.stats

    def run_logged(self) -> None:
        """:meth:`run` for a thread: an unexpected error is logged, never raised."""
        try:
            self.run()
        except Exception:
            logger.exception("the pipeline runner stopped on an error")

    def process(self, batch: batches.ClaimedBatch) -> None:
        started = time.monotonic()
        with batches.Heartbeat(batch, lease=self.lease) as beat:
            watcher = threading.Thread(
                target=self._watch, args=(beat.lost,), name="fairqueue-pipeline-watch"
            )
            finished = self._finished = threading.Event()
            watcher.start()
            try:
                outcome = execute_batch(
                    self.spark, batch, job_group=self._tag, lease_lost=beat.lost.is_set
                )
            except LeaseLost as exc:
                self.stats.lost += 1
                logger.warning("batch %s: %s", batch.id, exc)
            except Exception as exc:
                self._settle_error(batch, exc, lost=beat.lost.is_set())
            else:
                self.stats.succeeded += 1
                self.stats.rows += outcome.rows
                logger.info(
                    "batch %s (%s %s..%s): %d rows in %.1f s (Spark %.1f s, merge %.1f s)",
                    batch.id,
                    batch.job_name,
                    batch.start_id,
                    batch.end_id,
                    outcome.rows,
                    time.monotonic() - started,
                    outcome.spark_seconds,
                    outcome.merge_seconds,
                )
                if self.on_batch is not None:
                    self.on_batch(outcome)
            finally:
                finished.set()
                watcher.join()

    def _watch(self, lost: threading.Event) -> None:
        """Cancel the Spark job when the lease is lost or the runner stops."""
        while not self._finished.wait(0.25):
            if lost.is_set() or self.stopping.is_set():
                self._cancel()
                return

    def _settle_error(self, batch: batches.ClaimedBatch, exc: Exception, *, lost: bool) -> None:
        if lost:
            self.stats.lost += 1
            logger.warning("batch %s: lease lost; Spark job cancelled", batch.id)
            return
        if self.stopping.is_set():
            if batches.release(batch):
                self.stats.released += 1
                logger.info("batch %s released (shutting down)", batch.id)
            return
        # A bad formula or declaration fails the same way on every attempt: dead-letter it.
        final = isinstance(exc, FormulaError | PipelineError | UnknownPipeline)
        state = batches.fail(batch, exc, final=final, worker_id=self.worker_id)
        self.stats.failed += 1
        logger.error("batch %s (%s) failed, now %s: %s", batch.id, batch.job_name, state, exc)


def describe(pipeline: Pipeline) -> dict[str, Any]:
    """A pipeline's declaration, for ``fairpipeline status --json``."""
    return {
        "name": pipeline.name,
        "source": pipeline.source.table_name,
        "id_column": pipeline.source.id_column,
        "tenant_column": pipeline.source.tenant_column,
        "sink": pipeline.sink.table_name,
        "key": list(pipeline.sink.key),
        "batch_size": pipeline.batch_size,
    }
