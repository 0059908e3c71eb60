"""Planning pipeline jobs and running their batches: claim -> heartbeat -> Spark -> fenced.

One :class:`PipelineRunner` per process runs one batch at a time on the process's SparkSession
(a batch already uses every core Spark has). ``manage.py fairpipeline run`` runs it in the
foreground; ``manage.py runfairworker --pipelines`` runs it in a thread next to the message
threads.

Errors of the infrastructure (:mod:`.cluster`: the executors' Python, the database unreachable,
executors lost) do not use up a batch's attempts: the batch is given back and the runner pauses,
with a growing pause, until a check of the executors passes. An outage that leaves a batch's
Spark job waiting rather than failing (no executor for ``EXECUTOR_TIMEOUT`` seconds, the master
gone) is seen by a watchdog thread, which cancels the job: the batch is given back the same way
and the session rebuilt. Errors of the data or the formulas count an attempt, as they would
fail again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from django_fairqueue import batches, conf, limits
from django_fairqueue.contrib.pipeline import cluster, datastore
from django_fairqueue.contrib.pipeline.batch_run import (
    BatchOutcome,
    JobCancelled,
    drop_orphaned_staging,
    execute_batch,
)
from django_fairqueue.contrib.pipeline.core import (
    Pipeline,
    UnknownPipeline,
    parse_job_name,
    registry,
)
from django_fairqueue.contrib.pipeline.execute import PipelineError, not_null_fills, prepare
from django_fairqueue.contrib.pipeline.formulas import FormulaError
from django_fairqueue.contrib.pipeline.models import PipelineJob
from django_fairqueue.exceptions import LeaseLost
from django_fairqueue.maintenance import DeltaFolder
from django_fairqueue.models import BatchState, WorkBatch
from django_fairqueue.runtime import StopFlag

logger = logging.getLogger("django_fairqueue.pipeline")

#: How often a runner drops orphaned staging tables and rescues expired batches.
MAINTENANCE_INTERVAL = 30.0
#: The most runners one process runs (``--runners``): each is a thread with its own batch and
#: Spark job, and holds database connections (its own, its heartbeat's, and one per Spark task
#: of its batch: about six with two partitions); past a machine's cores more only wait.
MAX_RUNNERS = 16
#: A batch that fails this many times in a row on an infrastructure error while the check of the
#: executors passes in between is charged an attempt: the batch itself may be the cause.
INFRASTRUCTURE_STRIKES = 3


@dataclass
class PlanReport:
    """What :func:`plan` did: the jobs planned, and the tenants it could not plan, with why."""

    planned: list[batches.PlanResult]
    refused: dict[str, Exception]
    versions: dict[str, str]  # tenant -> the formula version its job is pinned to
    #: tenant -> what to know before the job runs (a NOT NULL column a rule may leave blank)
    warnings: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def plan(
    name: str,
    *,
    tenants: Sequence[str] | None = None,
    batch_size: int | None = None,
    progress: bool | Callable[[int, float], None] = False,
    rerun: bool = False,
    output: str | None = None,
) -> PlanReport:
    """Check each tenant's formulas, pin them, and plan one job per tenant (``pipeline:tenant``).

    A tenant whose formulas are invalid is refused (``report.refused``, with the
    :class:`FormulaError` naming the formula) and the others are planned: one tenant's mistake
    blocks only that tenant. No Spark session is needed.

    A job is pinned to the formula set it was planned with (its content hash, the version):
    planning again with the same formulas adds batches for rows appended since (a job whose
    batches were pruned is planned anew from the start); with edited formulas, a finished (or
    cancelled) job is planned anew from the start under the new version, while an unfinished
    one is refused (cancel it, or wait). ``rerun``: plan a finished job again from the start.

    ``output``: where the jobs write, ``"sink"`` or ``"long"`` (the pipeline's ``long_sink``);
    default: the job's current output (``"sink"`` for a new job). Changing it plans the job
    anew, like edited formulas.
    """
    pipeline = registry.get(name)
    chosen = list(tenants) if tenants is not None else pipeline.tenant_names()
    if not chosen:
        raise PipelineError(f"pipeline {name!r} has no tenants to plan")
    report = PlanReport(planned=[], refused={}, versions={})
    for tenant in chosen:
        try:
            prepared = prepare(pipeline, tenant, output=output or _output_of(pipeline, tenant))
            _pin(pipeline, tenant, prepared, rerun=rerun)
        except (FormulaError, PipelineError) as exc:
            report.refused[tenant] = exc
            continue
        report.versions[tenant] = prepared.fingerprint
        notes = not_null_warnings(prepared)
        if notes:
            report.warnings[tenant] = notes
        report.planned.append(
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
        )
    return report


_UNFINISHED = (BatchState.PENDING, BatchState.RUNNING)


def not_null_warnings(prepared: Any) -> list[str]:
    """One line per NOT NULL sink column a rule writes: what a blank or error value becomes."""
    return [
        f"tenant {prepared.tenant!r}: sink column {column!r} is NOT NULL: where rule {column} "
        f"is blank or an error, the column gets {fill!r} (the model field's default, else "
        "the empty value of its type); make the column nullable to keep blanks"
        for column, fill in not_null_fills(prepared).items()
    ]


def _output_of(pipeline: Pipeline, tenant: str) -> str:
    """The output the tenant's job writes now (``"sink"`` if it has no job yet)."""
    job = (
        PipelineJob.objects.using(pipeline.alias)
        .filter(job_name=pipeline.job_name(tenant))
        .values_list("output", flat=True)
        .first()
    )
    return job or "sink"


def _watermark(pipeline: Pipeline, tenant: str) -> str | None:
    """The highest value of the source's changed column over the tenant's rows (if declared)."""
    source = pipeline.source
    if source.changed_column is None:
        return None
    return datastore.watermark(
        pipeline.alias,
        table=source.table_name,
        changed_column=source.changed_column,
        tenant_column=source.tenant_column,
        tenant=tenant,
    )


def _pin(pipeline: Pipeline, tenant: str, prepared: Any, *, rerun: bool) -> None:
    """Record (or keep) the job's pinned formula set; clear a finished job to plan it anew."""
    alias = pipeline.alias
    job_name = pipeline.job_name(tenant)
    formulas = prepared.formulas.pairs() if prepared.formulas is not None else None
    with transaction.atomic(using=alias):
        job = PipelineJob.objects.using(alias).select_for_update().filter(job_name=job_name).first()
        job_batches = WorkBatch.objects.using(alias).filter(job_name=job_name)
        if job is None:
            if job_batches.exists():  # planned before jobs were pinned: start afresh
                _clear(job_batches, job_name)
            PipelineJob.objects.using(alias).create(
                job_name=job_name,
                pipeline=pipeline.name,
                tenant=tenant,
                version=prepared.fingerprint,
                formulas=formulas,
                today=prepared.today,
                output=prepared.output,
                watermark=_watermark(pipeline, tenant),
            )
            return
        job.record_success(job_batches)
        changed = job.version != prepared.fingerprint or job.output != prepared.output
        # A job without batches (pruned once finished) is planned from its first id again:
        # that is a new run, which must not inherit the last one's aggregates, TODAY() and
        # error counts.
        if not changed and not rerun and job_batches.exists():
            if job.cancelled_at is not None:
                job.cancelled_at = None
                job.save(update_fields=["cancelled_at"])
            return
        unfinished = job_batches.filter(state__in=_UNFINISHED).count()
        if unfinished and job.cancelled_at is None:
            what = ""
            if job.version != prepared.fingerprint:
                what = f"its formulas changed (now version {prepared.fingerprint})"
            elif job.output != prepared.output:
                what = f"its output changed (now {prepared.output})"
            raise PipelineError(
                f"tenant {tenant!r}: job {job_name} (version {job.version}) still has "
                f"{unfinished} unfinished batches{'; ' + what if what else ''}: wait for it or "
                f"cancel it (fairpipeline cancel {pipeline.name} --tenant {tenant}), then plan "
                "again"
            )
        _clear(job_batches, job_name)
        _restart(job, prepared, formulas, watermark=_watermark(pipeline, tenant))


def _restart(
    job: PipelineJob,
    prepared: Any,
    formulas: Any,
    *,
    watermark: str | None,
    changed_since: str | None = None,
    today: Any = None,
) -> None:
    """Start the job's new run (its batches already cleared): every row, or only the rows
    changed since ``changed_since``."""
    job.version = prepared.fingerprint
    job.formulas = formulas
    job.today = today or prepared.today
    job.output = prepared.output
    job.changed_since = changed_since
    job.watermark = watermark
    job.errors = {}
    job.aggregates = None
    job.cancelled_at = None
    job.created_at = timezone.now()
    job.save()


@dataclass
class Recompute:
    """What ``recompute`` decided for one tenant, and why."""

    tenant: str
    scope: str  # "all" (every row), "changed" (rows changed since), "none" (up to date)
    reason: str
    version: str
    planned: batches.PlanResult | None = None


@dataclass
class RecomputeReport:
    tenants: list[Recompute]
    refused: dict[str, Exception]


def recompute(
    name: str,
    *,
    tenants: Sequence[str] | None = None,
    output: str | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
    progress: bool | Callable[[int, float], None] = False,
) -> RecomputeReport:
    """Bring each tenant's results up to date with its formulas and its rows, computing only
    what changed since the tenant's last successful run (a job whose batches all succeeded):

    * formulas changed (their content hash differs from the last successful run's), a new
      output, or no successful run yet: every row of the tenant, under the new version;
    * else, with ``Source.changed_column``: only the rows whose changed column is above the
      last successful run's watermark (all rows if the formulas use tenant aggregates, whose
      values depend on every row); none changed: nothing to do;
    * else nothing to do (``plan --rerun`` recomputes every row).

    A tenant whose job is still running is refused (wait, or cancel it), as are invalid
    formulas. ``dry_run``: decide and report, plan nothing.
    """
    pipeline = registry.get(name)
    chosen = list(tenants) if tenants is not None else pipeline.tenant_names()
    if not chosen:
        raise PipelineError(f"pipeline {name!r} has no tenants to recompute")
    report = RecomputeReport(tenants=[], refused={})
    for tenant in chosen:
        try:
            prepared = prepare(pipeline, tenant, output=output or _output_of(pipeline, tenant))
            decided = _recompute_tenant(pipeline, tenant, prepared, dry_run=dry_run)
        except (FormulaError, PipelineError) as exc:
            report.refused[tenant] = exc
            continue
        if decided.scope != "none" and not dry_run:
            decided.planned = _plan_run(pipeline, tenant, decided, batch_size, progress)
        report.tenants.append(decided)
    return report


def _recompute_tenant(
    pipeline: Pipeline, tenant: str, prepared: Any, *, dry_run: bool
) -> Recompute:
    alias = pipeline.alias
    job_name = pipeline.job_name(tenant)
    version = prepared.fingerprint
    formulas = prepared.formulas.pairs() if prepared.formulas is not None else None
    source = pipeline.source
    with transaction.atomic(using=alias):
        jobs = PipelineJob.objects.using(alias).filter(job_name=job_name)
        job = (jobs if dry_run else jobs.select_for_update()).first()
        job_batches = WorkBatch.objects.using(alias).filter(job_name=job_name)
        if job is not None:
            unfinished = job_batches.filter(state__in=_UNFINISHED).count()
            if unfinished and job.cancelled_at is None:
                raise PipelineError(
                    f"tenant {tenant!r}: job {job_name} still has {unfinished} unfinished "
                    f"batches: wait for it or cancel it (fairpipeline cancel {pipeline.name} "
                    f"--tenant {tenant}), then recompute"
                )
            # a dry run decides as the recompute would, writing nothing
            job.record_success(job_batches, save=not dry_run)
        # Read before anything is planned: a row changed later is above it, so the next
        # recompute finds it.
        watermark = _watermark(pipeline, tenant)
        scope, reason, since = "all", "", None
        if job is None or not job.succeeded_version:
            reason = "no successful run yet"
        elif job.succeeded_version != version:
            reason = f"formulas changed since the last successful run ({job.succeeded_version})"
        elif job.succeeded_output != prepared.output:
            reason = f"output changed ({job.succeeded_output} -> {prepared.output})"
        elif source.changed_column is None:
            scope = "none"
            reason = (
                "formulas unchanged since the last successful run; the source declares no "
                "changed column (plan --rerun recomputes every row)"
            )
        elif job.succeeded_watermark is None:
            reason = f"the last successful run saw no {source.changed_column}"
            if watermark is None:
                scope, reason = "none", f"no row has a {source.changed_column}"
        elif not datastore.changed_since(
            alias,
            table=source.table_name,
            changed_column=source.changed_column,
            tenant_column=source.tenant_column,
            tenant=tenant,
            since=job.succeeded_watermark,
        ):
            scope = "none"
            reason = f"no row changed since {job.succeeded_watermark}"
        elif prepared.formulas is not None and prepared.formulas.aggregates:
            reason = (
                f"rows changed since {job.succeeded_watermark} and the formulas use tenant "
                "aggregates (every row's value may change)"
            )
        else:
            scope, since = "changed", job.succeeded_watermark
            reason = f"rows changed since {since}"
        decided = Recompute(tenant=tenant, scope=scope, reason=reason, version=version)
        if scope == "none" or dry_run:
            return decided
        if job is None:
            job = PipelineJob.objects.using(alias).create(
                job_name=job_name,
                pipeline=pipeline.name,
                tenant=tenant,
                version=version,
                formulas=formulas,
                today=prepared.today,
                output=prepared.output,
                watermark=watermark,
            )
            if job_batches.exists():
                _clear(job_batches, job_name)
            return decided
        _clear(job_batches, job_name)
        # A run of changed rows keeps the date of the rows it joins: TODAY() stays one date.
        today = job.today if scope == "changed" else None
        _restart(job, prepared, formulas, watermark=watermark, changed_since=since, today=today)
    return decided


def _plan_run(
    pipeline: Pipeline,
    tenant: str,
    decided: Recompute,
    batch_size: int | None,
    progress: bool | Callable[[int, float], None],
) -> batches.PlanResult:
    source = pipeline.source
    size = batch_size or pipeline.batch_size
    if decided.scope == "changed":
        job = PipelineJob.objects.using(pipeline.alias).get(job_name=pipeline.job_name(tenant))
        assert source.changed_column is not None and job.changed_since is not None
        windows = datastore.changed_windows(
            pipeline.alias,
            table=source.table_name,
            id_column=source.id_column,
            changed_column=source.changed_column,
            tenant_column=source.tenant_column,
            tenant=tenant,
            since=job.changed_since,
            size=size,
        )
        return batches.plan_ranges(
            pipeline.job_name(tenant),
            channel=tenant,
            ranges=windows,
            max_attempts=pipeline.max_attempts,
            using=pipeline.alias,
        )
    return batches.plan(
        pipeline.job_name(tenant),
        channel=tenant,
        table=source.table_name,
        id_column=source.id_column,
        batch_size=size,
        max_attempts=pipeline.max_attempts,
        filters={source.tenant_column: tenant} if source.tenant_column else None,
        progress=progress,
        using=pipeline.alias,
    )


def _clear(job_batches: Any, job_name: str) -> None:
    running = job_batches.filter(state=BatchState.RUNNING).count()
    if running:
        raise PipelineError(
            f"job {job_name} has {running} running batches; plan again when they end"
        )
    job_batches.delete()


def cancel(name: str, *, tenants: Sequence[str] | None = None) -> dict[str, int]:
    """Cancel jobs: pending batches are dropped, running ones write nothing when they end
    (their batch fails with :class:`JobCancelled`). Returns tenant -> batches dropped."""
    pipeline = registry.get(name)
    alias = pipeline.alias
    chosen = list(tenants) if tenants is not None else None
    jobs = PipelineJob.objects.using(alias).filter(pipeline=name, cancelled_at__isnull=True)
    if chosen is not None:
        jobs = jobs.filter(tenant__in=chosen)
    dropped: dict[str, int] = {}
    for job in jobs:
        with transaction.atomic(using=alias):
            locked = PipelineJob.objects.using(alias).select_for_update().get(pk=job.pk)
            # A run that already finished stays the last successful one (recompute reads it).
            locked.record_success(WorkBatch.objects.using(alias).filter(job_name=job.job_name))
            locked.cancelled_at = timezone.now()
            locked.save(update_fields=["cancelled_at"])
            count, _ = (
                WorkBatch.objects.using(alias)
                .filter(job_name=job.job_name, state=BatchState.PENDING)
                .delete()
            )
        dropped[job.tenant] = count
    return dropped


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
    #: Pauses after an infrastructure error (no attempt used).
    paused: int = 0


def fold_all_deltas(alias: str) -> int:
    """Fold pending channel counter deltas into the channel rows with a message worker's
    folder (up to 1,000,000 at a time); return how many were folded."""
    return DeltaFolder(max_batches=100, using=alias).run_once()


class _Quota:
    """At most ``limit`` batches over the runners sharing it (``--max-batches``)."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit
        self._lock = threading.Lock()

    def reserve(self) -> bool:
        """Take one batch's place before claiming; False once none is left."""
        with self._lock:
            if self.left is None:
                return True
            if self.left <= 0:
                return False
            self.left -= 1
            return True

    def give_back(self) -> None:
        """The claim found nothing: the place is free again."""
        with self._lock:
            if self.left is not None:
                self.left += 1


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
        quota: _Quota | None = None,
    ) -> None:
        cfg = conf.get()
        limits.not_one_name(pipelines, "pipelines")
        limits.not_one_name(channels, "channels")
        self.worker_id = worker_id
        self.pipelines = list(pipelines) if pipelines else None
        self.channels = list(channels) if channels else None
        #: None: ``FAIRQUEUE['LEASE_SECONDS']`` (the claim and the heartbeat read it)
        self.lease = lease
        self.poll_interval = poll_interval if poll_interval is not None else cfg.POLL_INTERVAL
        self.burst = burst
        self.quota = quota if quota is not None else _Quota(max_batches)
        self.spark = spark
        self.on_batch = on_batch
        self.stats = RunnerStats()
        self.stopping = StopFlag()  # safe to set from a signal handler
        self._tag = f"fairqueue-{uuid.uuid4().hex[:12]}"
        self._next_maintenance = 0.0
        self._finished = threading.Event()
        #: The thread running :meth:`run_logged`, when a worker runs the runner next to it.
        self.thread: threading.Thread | None = None
        #: Why the runner is paused (an :class:`~.cluster.InfrastructureError`), else None.
        self.paused_by: cluster.InfrastructureError | None = None
        #: When the current pause ends (``time.monotonic()``), else None.
        self.paused_until: float | None = None
        self._pause = 0.0
        self._strikes: dict[int, int] = {}
        self._pending: tuple[cluster.InfrastructureError, BaseException] | None = None
        #: The outage the watchdog cancelled the running batch's Spark job for (the watcher
        #: thread appends it; at most one per batch).
        self._outage: list[cluster.InfrastructureError] = []
        self._own_session = spark is None

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
        """Return expired batches to the queue; drop orphaned staging tables; fold counter
        deltas (a channel's new batches are seen by the claim once its delta is folded; a
        claim folds a bounded number, oldest first, so a backlog of other channels' deltas,
        with no message worker running, would otherwise hide them)."""
        for alias in self._aliases():
            fold_all_deltas(alias)
            rescued = batches.rescue_expired(using=alias)
            if rescued:
                logger.info("rescued %d work batches whose lease expired", len(rescued))
            dropped = drop_orphaned_staging(alias)
            if dropped:
                logger.info("dropped %d orphaned staging tables", len(dropped))

    def run(self) -> RunnerStats:
        """Run batches until stopped (or, with ``burst``, until none is ready).

        A master that cannot be reached fails here, when the session starts
        (:class:`~.spark.SparkClusterError`). Later infrastructure errors pause the runner; with
        ``burst`` they stop it, raising the :class:`~.cluster.InfrastructureError`.
        """
        from django_fairqueue.contrib.pipeline.spark import describe_session, get_session

        patterns = job_patterns(self.pipelines)
        if self.spark is None:
            self.spark = get_session()
        logger.info("pipeline runner %s: %s", self.worker_id, describe_session(self.spark))
        try:
            while not self.stopping.is_set():
                if not self.quota.reserve():  # before the claim: runners may share the quota
                    break
                try:
                    if time.monotonic() >= self._next_maintenance:
                        self.maintain()
                        self._next_maintenance = time.monotonic() + MAINTENANCE_INTERVAL
                    self._check()
                    batch = self._claim(patterns)
                except Exception as exc:
                    self.quota.give_back()
                    error = cluster.infrastructure_error(exc)
                    if error is None:
                        raise
                    if self.stopping.is_set():
                        break
                    self._pause_for(error, exc)
                    continue
                if batch is None:
                    self.quota.give_back()
                    if self.burst:
                        break
                    self.stopping.wait(self.poll_interval)
                    continue
                self.process(batch)
                if self._pending is not None:
                    self.quota.give_back()  # the batch was given back, not run
                    error, cause = self._pending
                    self._pending = None
                    self._pause_for(error, cause)
                    continue
        finally:
            for alias in connections:
                connections[alias].close()
        return self.stats

    def _claim(self, patterns: list[str]) -> batches.ClaimedBatch | None:
        def claim() -> batches.ClaimedBatch | None:
            return batches.claim(
                worker_id=self.worker_id, jobs=patterns, lease=self.lease, channels=self.channels
            )

        claimed = claim()
        if claimed is None and self.burst:
            # Before a burst ends: fold every pending delta, then ask once more.
            folded = sum(fold_all_deltas(alias) for alias in self._aliases())
            if folded:
                claimed = claim()
        return claimed

    def run_logged(self) -> None:
        """:meth:`run` for a thread: an unexpected error is logged, never raised."""
        try:
            self.run()
        except Exception:
            logger.exception("the pipeline runner stopped on an error")

    # ---- infrastructure: the executors' check, pauses, scheduler pools

    def _check(self) -> None:
        """Before claiming: check the executors (once, then again after each pause)."""
        from django_fairqueue.contrib.pipeline.spark import (
            executor_conninfo,
            get_session,
            spark_settings,
        )

        if self.spark is None:  # the session stopped and was dropped: build a new one
            self.spark = get_session()
        settings = spark_settings()
        result = cluster.check(
            self.spark,
            sorted({executor_conninfo(alias) for alias in self._aliases()}),
            executor_timeout=settings.executor_timeout,
            job_tag=self._tag,
            wait=self.stopping.wait,
        )
        if result is not None:
            executors = ", ".join(result.executors) or "local mode"
            logger.info(
                "pipeline runner %s: executors checked in %.1f s (executors: %s; Python: %s)",
                self.worker_id,
                result.seconds,
                executors,
                "; ".join(result.pythons),
            )
        if self.paused_by is not None:
            logger.warning(
                "pipeline runner %s resumed: the executors' check passes (paused %d time(s) "
                "by: %s)",
                self.worker_id,
                self.stats.paused,
                self.paused_by,
            )
            self.paused_by = None
            self._pause = 0.0

    def _pause_for(self, error: cluster.InfrastructureError, cause: BaseException) -> None:
        """Pause after an infrastructure error (stop, raising it, in burst mode)."""
        from django_fairqueue.contrib.pipeline.spark import spark_settings, stop_session

        settings = spark_settings()
        self.stats.paused += 1
        self.paused_by = error
        cluster.forget(self.spark)
        for alias in connections:  # a broken connection is reopened on the next use
            connections[alias].close_if_unusable_or_obsolete()
        if error.kind in cluster.REBUILD_KINDS and self._own_session:
            try:
                stop_session()
            except Exception as exc:
                logger.debug("stopping the Spark session failed: %s", exc)
            self.spark = None
        if self.burst:
            raise error from cause
        self._pause = min(max(self._pause * 2, settings.pause_seconds), settings.pause_max_seconds)
        self.paused_until = time.monotonic() + self._pause
        logger.error(
            "pipeline runner %s paused for %.0f s: %s. No batch attempt is used; the runner "
            "checks the executors before it claims again",
            self.worker_id,
            self._pause,
            error,
        )
        try:
            self.stopping.wait(self._pause)
        finally:
            self.paused_until = None

    def _pool(self, batch: batches.ClaimedBatch) -> str | None:
        """The batch's channel's Spark scheduler pool (weighted like the channel)."""
        from django_fairqueue.models import Channel

        if self.spark is None or not cluster.fair(self.spark):
            return None
        alias = registry.get(parse_job_name(batch.job_name)[0]).alias
        weight = (
            Channel.objects.using(alias)
            .filter(pk=batch.channel_id)
            .values_list("weight", flat=True)
            .first()
        )
        return cluster.ensure_pool(self.spark, batch.channel, weight or 1)

    def process(self, batch: batches.ClaimedBatch) -> None:
        from django_fairqueue.contrib.pipeline.spark import spark_settings

        started = time.monotonic()
        self._outage.clear()
        with batches.Heartbeat(batch, lease=self.lease) as beat:
            watchdog = cluster.Watchdog(self.spark, spark_settings().executor_timeout)
            watcher = threading.Thread(
                target=self._watch,
                args=(batch, beat.lost, watchdog),
                name="fairqueue-pipeline-watch",
            )
            finished = self._finished = threading.Event()
            watcher.start()
            pool = None
            try:
                pool = self._pool(batch)
                if pool is not None:
                    self.spark.sparkContext.setLocalProperty(cluster.POOL_PROPERTY, pool)
                outcome = execute_batch(
                    self.spark,
                    batch,
                    job_group=self._tag,
                    lease_lost=beat.lost.is_set,
                    stopping=self.stopping.is_set,
                )
            except LeaseLost as exc:
                self.stats.lost += 1
                logger.warning("batch %s: %s", batch.id, exc)
            except Exception as exc:
                self._settle_error(batch, exc, lost=beat.lost.is_set())
            else:
                if self._outage:  # the job ended as the watchdog cancelled it
                    cluster.forget(self.spark)  # check the executors before the next claim
                    self._outage.clear()
                self._strikes.pop(batch.id, None)
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
                if pool is not None and self.spark is not None:
                    self.spark.sparkContext.setLocalProperty(cluster.POOL_PROPERTY, None)
                finished.set()
                watcher.join()

    def _watch(
        self, batch: batches.ClaimedBatch, lost: threading.Event, watchdog: cluster.Watchdog
    ) -> None:
        """Cancel the Spark job when the lease is lost, the runner stops, or the watchdog sees
        an outage (the job would wait for executors for ever)."""
        while not self._finished.wait(0.25):
            if lost.is_set() or self.stopping.is_set():
                # At every tick until the batch ends: a job the batch starts after the first
                # cancel (the driver was still planning it, or reading aggregates) is
                # cancelled too.
                self._cancel()
                continue
            try:
                outage = watchdog.look()
            except Exception as exc:  # the driver's JVM itself went away
                outage = cluster.infrastructure_error(exc) or cluster.InfrastructureError(
                    cluster.SESSION_STOPPED, str(exc)[:500]
                )
            if outage is not None:
                self._outage.append(outage)
                logger.error(
                    "batch %s (%s): %s; cancelling its Spark job", batch.id, batch.job_name, outage
                )
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
        if self._outage:  # the cluster's doing, whatever the cancelled job raised
            outage = self._outage.pop()
            self._give_back(batch, outage)
            self._pending = (outage, exc)
            return
        error = cluster.infrastructure_error(exc)
        if error is not None:
            strikes = self._strikes[batch.id] = self._strikes.get(batch.id, 0) + 1
            if strikes < INFRASTRUCTURE_STRIKES:
                self._give_back(batch, error)
                self._pending = (error, exc)  # the runner pauses once the heartbeat stopped
                return
            logger.error(
                "batch %s failed %d times in a row on %s while the executors' check passed in "
                "between: counting an attempt",
                batch.id,
                strikes,
                error.kind,
            )
            self._strikes.pop(batch.id, None)
        # A bad formula or declaration fails the same way on every attempt: dead-letter it.
        final = isinstance(exc, FormulaError | PipelineError | UnknownPipeline | JobCancelled)
        state = batches.fail(batch, exc, final=final)
        self.stats.failed += 1
        logger.error("batch %s (%s) failed, now %s: %s", batch.id, batch.job_name, state, exc)

    def _give_back(self, batch: batches.ClaimedBatch, error: cluster.InfrastructureError) -> None:
        try:
            released = batches.release(batch)
        except Exception as exc:  # the database itself may be what is down
            logger.error(
                "batch %s could not be given back (%s): it is retried when its lease expires",
                batch.id,
                exc,
            )
            return
        if released:
            self.stats.released += 1
            logger.warning(
                "batch %s (%s) given back, no attempt used: %s", batch.id, batch.job_name, error
            )


class RunnerGroup:
    """``count`` runners in threads of one process, sharing its Spark session: each claims and
    runs its own batch, so one batch's driver-side planning and its merge (one database
    backend) overlap the other batches' Spark phases instead of leaving cores idle.

    ``options`` are :class:`PipelineRunner`'s; ``max_batches`` counts over the group. Each
    runner records ``worker_id/k`` on its batches (``worker_id`` itself when ``count`` is 1).
    """

    def __init__(self, count: int, *, worker_id: str, max_batches: int | None = None,
                 **options: Any) -> None:  # fmt: skip
        if type(count) is not int or not 1 <= count <= MAX_RUNNERS:  # a bool is no count
            raise ValueError(
                f"the number of runners must be a whole number from 1 to {MAX_RUNNERS}, "
                f"got {count!r}"
            )
        quota = _Quota(max_batches)
        self.runners = [
            PipelineRunner(
                worker_id=worker_id if count == 1 else f"{worker_id}/{k + 1}",
                max_batches=max_batches,
                quota=quota,
                **options,
            )
            for k in range(count)
        ]
        self.stopping = self.runners[0].stopping
        #: The thread running :meth:`run_logged`, when a worker runs the group next to it.
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        for runner in self.runners:
            runner.stop()

    def run_logged(self) -> None:
        """:meth:`run` for a thread: an unexpected error is logged, never raised."""
        try:
            self.run()
        except Exception:
            logger.exception("the pipeline runners stopped on an error")

    def run(self) -> RunnerStats:
        """Run every runner until all have stopped; their statistics added up. The first
        error a runner raised is raised once all have stopped (the others are stopped)."""
        if len(self.runners) == 1:
            return self.runners[0].run()
        from django_fairqueue.contrib.pipeline.spark import get_session

        spark = self.runners[0].spark or get_session()
        errors: list[BaseException] = []

        def run(runner: PipelineRunner) -> None:
            try:
                runner.run()
            except BaseException as exc:
                errors.append(exc)
                self.stop()

        threads = []
        for runner in self.runners:
            runner.spark = spark
            thread = threading.Thread(target=run, args=(runner,), name=runner.worker_id)
            runner.thread = thread
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        total = RunnerStats()
        for runner in self.runners:
            for field in dataclasses.fields(RunnerStats):
                setattr(total, field.name,
                        getattr(total, field.name) + getattr(runner.stats, field.name))  # fmt: skip
        return total


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
