"""``manage.py fairpipeline plan|recompute|run|status|retry|cancel|bench``: the Spark data
pipeline.

Needs the ``spark`` extra for ``run`` and ``bench`` (``pip install 'django-fairqueue[spark]'``);
``plan`` and ``recompute`` check formulas without Spark; ``status``, ``retry`` and ``cancel``
only read and update jobs and work batches. Guide: docs/howto/spark-pipeline.md.
"""

from __future__ import annotations

import json
import signal
import sys
from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from django_fairqueue import limits
from django_fairqueue.cli.terminal import json_text
from django_fairqueue.contrib.pipeline.runner import MAX_RUNNERS
from django_fairqueue.management.base import FairCommand
from django_fairqueue.management.commands.runfairworker import MAX_SECONDS
from django_fairqueue.runtime import command_logging


def _spark_conf(options: dict[str, Any]) -> dict[str, str]:
    """``--conf KEY=VALUE ...`` as a dict; a malformed item is a :class:`CommandError`."""
    found = {}
    for item in options["conf"] or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--conf takes KEY=VALUE, got {item!r}")
        found[key.strip()] = value
    return found


def _last_errors(job_names: list[str]) -> dict[str, dict[str, Any]]:
    """Per job, the error of its batch that failed last, among batches still failed or
    waiting for a retry (a batch that then succeeded is left out)."""
    from django_fairqueue.models import BatchState, WorkBatch

    found: dict[str, dict[str, Any]] = {}
    failed = (
        WorkBatch.objects.filter(job_name__in=job_names, last_error__isnull=False)
        .exclude(state=BatchState.SUCCEEDED)
        .order_by("job_name", "-finished_at", "-id")
        .values_list("job_name", "id", "state", "last_error")
    )
    for job_name, batch, state, error in failed:
        if job_name not in found and isinstance(error, dict):
            found[job_name] = {"batch": batch, "state": state, **error}
    return found


def _no_batches(job_name: str, tenant: str) -> Any:
    """The progress of a job that has no batches: cancelled before any ran, or pruned once
    every batch had succeeded (``FAIRQUEUE['BATCH_RETENTION']``)."""
    from django_fairqueue.batches import JobProgress

    return JobProgress(
        job_name=job_name,
        channel=tenant,
        batches_total=0,
        batches_by_state={"pending": 0, "running": 0, "succeeded": 0, "failed": 0},
        rows_total=0,
        rows_done=0,
        rows_written=0,
        started_at=None,
        last_finished_at=None,
        rows_per_second=None,
        eta=None,
    )


def _refused(
    refused: dict[str, Exception], done: int, what: str, *, dry_run: bool = False
) -> CommandError:
    """The error ``plan`` or ``recompute`` ends with when tenants were refused (each said why
    above); ``done``: how many tenants were planned or recomputed (``dry_run``: would be)."""
    total = len(refused) + done
    if done:
        others = "the others would be (dry run)" if dry_run else "the others are"
        return CommandError(f"{len(refused)} of {total} tenants not {what} (above); {others}")
    if total == 1:
        return CommandError(f"tenant {next(iter(refused))!r} was not {what} (above)")
    return CommandError(f"none of the {total} tenants was {what} (above)")


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Command(FairCommand):
    help = (
        "The Spark data pipeline: plan jobs (one per tenant), run their work batches, show "
        "progress, retry failed batches, or benchmark against the same formulas in SQL."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

        plan = sub.add_parser("plan", help="Check formulas, then plan a job per tenant.")
        plan.add_argument("pipeline", help="Pipeline name.")
        plan.add_argument("--tenant", action="append", help="Only this tenant (repeatable).")
        plan.add_argument("--batch-size", type=int, help="Rows per batch (default: pipeline's).")
        plan.add_argument(
            "--rerun",
            action="store_true",
            help="Plan finished jobs again from the start (every row recomputed).",
        )
        plan.add_argument(
            "--output",
            choices=["sink", "long"],
            help="Where the jobs write: the pipeline's sink, or its long sink (default: the "
            "job's current output; sink for a new job). A change plans the job anew.",
        )

        recompute = sub.add_parser(
            "recompute",
            help="Recompute what changed since each tenant's last successful run: every row "
            "if its formulas changed, else only the rows changed (Source changed_column).",
        )
        recompute.add_argument("pipeline")
        recompute.add_argument("--tenant", action="append", help="Only this tenant (repeatable).")
        recompute.add_argument("--batch-size", type=int, help="Rows per batch.")
        recompute.add_argument("--output", choices=["sink", "long"], help="As for plan.")
        recompute.add_argument(
            "--dry-run", action="store_true", help="Say what would be recomputed; plan nothing."
        )

        cancel = sub.add_parser(
            "cancel", help="Cancel jobs: pending batches dropped, running ones write nothing."
        )
        cancel.add_argument("pipeline")
        cancel.add_argument("--tenant", action="append", help="Only this tenant (repeatable).")

        run = sub.add_parser("run", help="Run pipeline batches until stopped.")
        run.add_argument("pipelines", nargs="*", help="Pipelines (default: all registered).")
        run.add_argument("--tenant", action="append", help="Only this tenant (repeatable).")
        run.add_argument("--burst", action="store_true", help="Exit once nothing is ready.")
        run.add_argument("--max-batches", type=int, metavar="N", help="Exit after N batches.")
        run.add_argument("--lease", type=float, metavar="SECONDS", help="Lease of a batch.")
        run.add_argument("--poll-interval", type=float, metavar="SECONDS")
        run.add_argument("--worker-id", help="Name recorded on claimed batches.")
        run.add_argument(
            "--runners",
            type=int,
            default=1,
            metavar="N",
            help="Run N batches at a time, in threads sharing one Spark session (default 1): "
            "a batch's planning and merge then overlap the others' Spark work.",
        )

        status = sub.add_parser("status", help="Progress of every pipeline job.")
        status.add_argument("pipeline", nargs="?", help="Only this pipeline's jobs.")
        status.add_argument("--json", action="store_true", help="Print JSON.")

        retry = sub.add_parser("retry", help="Put a job's failed batches back to pending.")
        retry.add_argument("pipeline")
        retry.add_argument("--tenant", action="append", help="Only this tenant (repeatable).")

        bench = sub.add_parser(
            "bench", help="Spark pipeline (both sink modes) vs one INSERT ... SELECT."
        )
        bench.add_argument(
            "--rows", type=int, action="append", help="Rows (repeatable; default 1000000)."
        )
        bench.add_argument(
            "--batch-size", type=int, help="Rows per batch (default: a tenant's rows)."
        )
        bench.add_argument("--tenants", type=int, default=10, help="Tenants (default 10).")
        bench.add_argument(
            "--rules", type=int, default=3, help="Formulas per tenant (default 3, at least 3)."
        )
        bench.add_argument(
            "--rules-kind",
            choices=("simple", "realistic"),
            default="simple",
            help="simple (default): arithmetic over four numeric columns; realistic: what "
            "analysts write (IF chains, text, dates, blanks, division, tenant aggregates, "
            "chains of 20 rules using rules), with its SQL twin for the baseline.",
        )
        bench.add_argument(
            "--contiguous",
            action="store_true",
            help="Give each tenant one run of ids (default: tenants' ids interleave, as in a "
            "table all of them write to).",
        )
        bench.add_argument(
            "--no-direct", action="store_true", help="Skip the Sink(atomic=False) run."
        )
        bench.add_argument(
            "--sql-connections",
            type=int,
            action="append",
            metavar="N",
            help="Run the SQL baseline on N connections at once (repeatable; default: 1, then "
            "one per CPU core; the fastest is the baseline).",
        )
        bench.add_argument(
            "--master",
            metavar="URL",
            help="Run the pipeline on this Spark master (e.g. spark://host:7077 or local[2]) "
            "instead of FAIRQUEUE_PIPELINE['SPARK']['MASTER'].",
        )
        bench.add_argument(
            "--partitions",
            type=int,
            metavar="N",
            help="Spark tasks per batch (FAIRQUEUE_PIPELINE['SPARK']['PARTITIONS']; on a "
            "standalone master also its spark.cores.max unless CORES_MAX is set).",
        )
        bench.add_argument(
            "--conf",
            action="append",
            metavar="KEY=VALUE",
            help="A Spark property for the benchmark's session (repeatable), over "
            "FAIRQUEUE_PIPELINE['SPARK']['CONF'].",
        )
        bench.add_argument(
            "--runners",
            type=int,
            default=1,
            metavar="N",
            help="Run the pipeline with N runners sharing the Spark session, as "
            "`fairpipeline run --runners N` does (default 1).",
        )
        bench.add_argument("--json", action="store_true", help="Print JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        with command_logging(options["verbosity"]):
            self._handle(options)

    def _handle(self, options: dict[str, Any]) -> None:
        action = options["action"]
        if any(not name.strip() for name in options.get("tenant") or ()):
            raise CommandError("--tenant needs a tenant's name (a channel), not an empty one")
        if not 1 <= options.get("runners", 1) <= MAX_RUNNERS:  # before Spark is looked for
            raise CommandError(f"--runners must be from 1 to {MAX_RUNNERS}")
        # Planning needs nothing of Spark's: a planner without PySpark installed (the web
        # host, say) checks formulas and plans what a Spark host runs.
        if action == "bench":
            self._check_bench(options)  # before Spark is looked for
        if action == "run":
            self._check_run(options)  # before Spark is looked for
        if action in ("run", "bench"):
            self._require_spark()
        getattr(self, f"_{action}")(options)

    def _require_spark(self) -> None:
        from django_fairqueue.contrib.pipeline.spark import (
            SparkUnavailable,
            require_java,
            require_pyspark,
        )

        try:
            require_pyspark()
            require_java()
        except SparkUnavailable as exc:
            raise CommandError(str(exc)) from None

    def _pipeline_errors(self) -> tuple[type[Exception], ...]:
        from django_fairqueue.contrib.pipeline.cluster import InfrastructureError
        from django_fairqueue.contrib.pipeline.core import UnknownPipeline
        from django_fairqueue.contrib.pipeline.execute import PipelineError
        from django_fairqueue.contrib.pipeline.formulas import FormulaError
        from django_fairqueue.contrib.pipeline.spark import SparkUnavailable

        return (
            FormulaError,
            PipelineError,
            UnknownPipeline,
            SparkUnavailable,
            InfrastructureError,
            ValueError,
        )

    # ---- plan

    def _plan(self, options: dict[str, Any]) -> None:
        from django_fairqueue.contrib.pipeline.runner import plan

        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        try:
            report = plan(
                options["pipeline"],
                tenants=options["tenant"],
                batch_size=options["batch_size"],
                progress=options["verbosity"] >= 1 and sys.stderr.isatty(),
                rerun=options["rerun"],
                output=options["output"],
            )
        except self._pipeline_errors() as exc:
            raise CommandError(str(exc)) from None
        for result in report.planned:
            tenant = result.job_name.partition(":")[2]
            self.stdout.write(
                f"{result.job_name} (formulas {report.versions.get(tenant, '-')}): "
                f"{result.created} new batches ({result.rows_planned:,} rows), "
                f"{result.batches_total} in all, {result.seconds:.1f} s"
            )
        for notes in report.warnings.values():
            for note in notes:
                self.stderr.write(f"warning: {note}")
        for refusal in report.refused.values():
            self.stderr.write(f"not planned: {refusal}")
        if report.refused:
            raise _refused(report.refused, len(report.planned), "planned")

    # ---- recompute

    def _recompute(self, options: dict[str, Any]) -> None:
        from django_fairqueue.contrib.pipeline.runner import recompute

        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        try:
            report = recompute(
                options["pipeline"],
                tenants=options["tenant"],
                output=options["output"],
                batch_size=options["batch_size"],
                dry_run=options["dry_run"],
                progress=options["verbosity"] >= 1 and sys.stderr.isatty(),
            )
        except self._pipeline_errors() as exc:
            raise CommandError(str(exc)) from None
        name = options["pipeline"]
        for decided in report.tenants:
            what = {"all": "every row", "changed": "changed rows", "none": "up to date"}
            line = f"{name}:{decided.tenant} (formulas {decided.version}): "
            line += f"{what[decided.scope]}: {decided.reason}"
            if decided.planned is not None:
                planned = decided.planned
                line += (
                    f"; {planned.created} new batches ({planned.rows_planned:,} rows), "
                    f"{planned.seconds:.1f} s"
                )
            elif decided.scope != "none":
                line += " (dry run: nothing planned)"
            self.stdout.write(line)
        for refusal in report.refused.values():
            self.stderr.write(f"not recomputed: {refusal}")
        if report.refused:
            raise _refused(
                report.refused, len(report.tenants), "recomputed", dry_run=options["dry_run"]
            )

    # ---- cancel

    def _cancel(self, options: dict[str, Any]) -> None:
        from django_fairqueue.contrib.pipeline.runner import cancel

        try:
            dropped = cancel(options["pipeline"], tenants=options["tenant"])
        except self._pipeline_errors() as exc:
            raise CommandError(str(exc)) from None
        for tenant, count in dropped.items():
            self.stdout.write(
                f"{options['pipeline']}:{tenant}: cancelled, {count} pending batches dropped"
            )
        if not dropped:
            self.stdout.write("no job to cancel")

    # ---- run

    def _check_run(self, options: dict[str, Any]) -> None:
        lease = options["lease"]
        # a worker's --lease bounds: the shortest lease a batch claim takes
        if lease is not None and not limits.MIN_LEASE <= lease <= MAX_SECONDS:
            raise CommandError(
                f"--lease must be {limits.MIN_LEASE:g} to {MAX_SECONDS:g} seconds, got {lease}"
            )
        if options["poll_interval"] is not None and not options["poll_interval"] > 0:
            raise CommandError("--poll-interval must be a positive number")
        if options["max_batches"] is not None and options["max_batches"] < 1:
            raise CommandError("--max-batches must be at least 1")

    def _run(self, options: dict[str, Any]) -> None:
        from django_fairqueue.contrib.pipeline.runner import RunnerGroup
        from django_fairqueue.worker import default_worker_id

        try:
            runner = RunnerGroup(
                options["runners"],
                worker_id=options["worker_id"] or default_worker_id(),
                pipelines=options["pipelines"] or None,
                channels=options["tenant"],
                lease=timedelta(seconds=options["lease"]) if options["lease"] else None,
                poll_interval=options["poll_interval"],
                burst=options["burst"],
                max_batches=options["max_batches"],
            )
        except self._pipeline_errors() as exc:
            raise CommandError(str(exc)) from None

        def stop(signum: int, frame: Any) -> None:
            if runner.stopping.is_set():
                raise SystemExit(1)  # a second signal: leave now
            self.stderr.write("stopping: cancelling the running batch(es) and giving them back")
            runner.stop()

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            stats = runner.run()
        except self._pipeline_errors() as exc:
            raise CommandError(str(exc)) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if options["verbosity"] >= 1:
            self.stderr.write(
                f"pipeline runner: {stats.succeeded} batches succeeded ({stats.rows:,} rows), "
                f"{stats.failed} failed, {stats.lost} lost their lease, {stats.released} released"
                + (
                    f", paused {stats.paused} time(s) by infrastructure errors"
                    if stats.paused
                    else ""
                )
            )

    # ---- status

    def _status(self, options: dict[str, Any]) -> None:
        from django_fairqueue import batches
        from django_fairqueue.contrib.pipeline.core import registry
        from django_fairqueue.contrib.pipeline.models import PipelineJob

        name = options["pipeline"]
        prefix = f"{name}:" if name else None
        jobs = batches.jobs(prefix=prefix)
        # A job cancelled before any batch ran, or pruned, has no batches: listed all the same.
        listed = {job.job_name for job in jobs}
        pinned_jobs = PipelineJob.objects.values_list("job_name", "tenant")
        if name:
            pinned_jobs = pinned_jobs.filter(pipeline=name)
        jobs += [_no_batches(job, tenant) for job, tenant in pinned_jobs if job not in listed]
        jobs.sort(key=lambda job: job.job_name)
        if name and not jobs:
            try:  # a name neither registered nor in the jobs is a typo, as for the others
                registry.get(name)
            except self._pipeline_errors() as exc:
                raise CommandError(str(exc)) from None
        if not name:
            known = tuple(f"{n}:" for n in registry.names())
            jobs = [job for job in jobs if job.job_name.startswith(known)] if known else []
        pinned = {
            p.job_name: p
            for p in PipelineJob.objects.filter(job_name__in=[j.job_name for j in jobs])
        }
        last_errors = _last_errors([j.job_name for j in jobs])
        if options["json"]:
            shown = []
            for job in jobs:
                row = job.as_dict()
                pin = pinned.get(job.job_name)
                row["version"] = pin.version if pin else None
                row["errors"] = dict(pin.errors) if pin else {}
                row["cancelled"] = bool(pin and pin.cancelled_at)
                row["last_error"] = last_errors.get(job.job_name)
                row["output"] = pin.output if pin else None
                row["changed_since"] = pin.changed_since if pin else None
                row["last_success"] = (
                    {
                        "version": pin.succeeded_version,
                        "output": pin.succeeded_output,
                        "watermark": pin.succeeded_watermark,
                        "at": pin.succeeded_at,
                    }
                    if pin and pin.succeeded_at
                    else None
                )
                shown.append(row)
            self.stdout.write(json_text(shown, indent=2))  # times in ISO 8601, with a "T"
            return
        if not jobs:
            self.stdout.write("no pipeline jobs")
            return
        header = (
            f"{'job':<32} {'state':<10} {'batches':>15} {'rows':>25} {'rows/s':>10} {'ETA':>8} "
            f"{'version':<16} {'errors':>8} {'output':<6} rows"
        )
        self.stdout.write(header)
        for job in jobs:
            by = job.batches_by_state
            done = f"{by['succeeded']}/{job.batches_total}" + (
                f" ({by['failed']} failed)" if by["failed"] else ""
            )
            rate = f"{job.rows_per_second:,.0f}" if job.rows_per_second else "-"
            eta = _eta(job.eta.total_seconds() if job.eta is not None else None)
            pin = pinned.get(job.job_name)
            state = "cancelled" if pin and pin.cancelled_at else job.state
            errors = sum(int(v) for v in pin.errors.values()) if pin else 0
            scope = "all"
            if pin is not None and pin.changed_since is not None:
                scope = f"changed since {pin.changed_since}"
            self.stdout.write(
                f"{job.job_name:<32} {state:<10} {done:>15} "
                f"{f'{job.rows_done:,}/{job.rows_total:,}':>25} {rate:>10} {eta:>8} "
                f"{pin.version if pin else '-':<16} {errors:>8,} "
                f"{pin.output if pin else '-':<6} {scope}"
            )
            failure = last_errors.get(job.job_name)
            if failure is not None:
                message = (failure.get("message") or "").strip().splitlines() or [""]
                self.stdout.write(
                    f"  last error (batch {failure['batch']}, {failure['state']}, attempt "
                    f"{failure.get('attempt')}): {failure.get('type')}: {message[0][:300]}"
                )

    # ---- retry

    def _retry(self, options: dict[str, Any]) -> None:
        from django_fairqueue import batches
        from django_fairqueue.contrib.pipeline.core import registry

        try:
            pipeline = registry.get(options["pipeline"])
        except self._pipeline_errors() as exc:
            raise CommandError(str(exc)) from None
        tenants = options["tenant"] or [
            job.job_name.partition(":")[2] for job in batches.jobs(prefix=f"{pipeline.name}:")
        ]
        total = 0
        for tenant in tenants:
            retried = batches.retry_failed(job_name=pipeline.job_name(tenant))
            total += len(retried)
            if retried:
                self.stdout.write(f"{pipeline.job_name(tenant)}: {len(retried)} batches retried")
        self.stdout.write(f"{total} failed batches back to pending")

    # ---- bench

    @staticmethod
    def _check_bench(options: dict[str, Any]) -> None:
        sizes = options["rows"] or [1_000_000]
        if any(n < 2 for n in sizes):
            raise CommandError("--rows must be at least 2")
        if options["tenants"] < 1 or any(n < options["tenants"] for n in sizes):
            raise CommandError("--tenants must be at least 1 and at most --rows")
        if options["rules"] < 3:
            raise CommandError("--rules must be at least 3")
        if any(n < 1 for n in options["sql_connections"] or ()):
            raise CommandError("--sql-connections must be at least 1")
        if options["partitions"] is not None and options["partitions"] < 1:
            raise CommandError("--partitions must be at least 1")
        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        _spark_conf(options)

    def _bench(self, options: dict[str, Any]) -> None:
        from django_fairqueue import conf
        from django_fairqueue.contrib.pipeline import bench

        sizes = options["rows"] or [1_000_000]
        spark_conf = _spark_conf(options)
        results = []
        for rows in sizes:
            try:
                result = bench.run(
                    rows,
                    using=conf.get().DATABASE,
                    batch_size=options["batch_size"],
                    tenants=options["tenants"],
                    rules=options["rules"],
                    rules_kind=options["rules_kind"],
                    contiguous=options["contiguous"],
                    direct=not options["no_direct"],
                    sql_connections=options["sql_connections"] or (),
                    say=lambda text: self.stderr.write(text),
                    master=options["master"],
                    partitions=options["partitions"],
                    spark_conf=spark_conf,
                    runners=options["runners"],
                )
            except self._pipeline_errors() as exc:
                raise CommandError(str(exc)) from None
            results.append(result)
            if not options["json"]:
                self.stdout.write(self._bench_report(result))
        if options["json"]:
            self.stdout.write(json.dumps([r.as_dict() for r in results], indent=2))
        if not all(r.results_match for r in results):
            raise CommandError("the Spark pipeline and the SQL baseline disagree")

    @staticmethod
    def _bench_report(r: Any) -> str:
        def cpu(value: float | None) -> str:
            return "not measured" if value is None else f"{value:.1f} us/row"

        def seconds(value: float | None) -> str:
            return "not run" if value is None else f"{value:.1f} s"

        layout = "interleaved" if r.interleaved else "contiguous"
        lines = [
            f"{r.rows:,} rows, {r.tenants} tenants ({layout} ids), {r.rules} {r.rules_kind} rules "
            "per tenant, "
            f"{r.batches} batches per Spark run, load average {r.load_average}",
            f"  Spark master {r.master}, "
            + (
                f"{r.executors} executor(s), {r.executors_measured} of them on this machine "
                "(their CPU is counted)"
                if r.executors
                else "tasks in the driver's JVM"
            )
            + f", {r.runners} runner(s)",
            f"  SQL baseline     {r.sql_seconds:7.1f} s ({r.sql_rows_per_second:,.0f} rows/s; "
            f"one connection {seconds(r.sql_serial_seconds)}, one per core "
            f"{seconds(r.sql_parallel_seconds)})  database CPU {cpu(r.sql_db_cpu_us_per_row)}",
            f"  Spark atomic     {r.spark_seconds:7.1f} s ({r.spark_rows_per_second:,.0f} rows/s, "
            f"{r.ratio:.2f}x SQL; plan {r.plan_seconds:.1f} s, Spark phase "
            f"{r.spark_phase_seconds:.1f} s, merge {r.merge_seconds:.1f} s)  database CPU "
            f"{cpu(r.spark_db_cpu_us_per_row)}, Spark and driver CPU "
            f"{cpu(r.spark_cpu_us_per_row)}",
        ]
        if r.batch_cpu_seconds and None not in r.batch_cpu_seconds:
            warm = r.warmup_cpu_seconds
            shown = ", ".join(f"{c:.1f}" for c in r.batch_cpu_seconds[:20])
            more = ", ..." if len(r.batch_cpu_seconds) > 20 else ""
            lines.append(
                f"  Spark and driver CPU per batch, in run order: {shown}{more} s (a tenant's "
                f"first batch carries its plan); the warm-up before: "
                + ("not measured" if warm is None else f"{warm:.1f} s")
            )
        if r.direct_seconds is not None:
            lines.append(
                f"  Spark atomic=False {r.direct_seconds:5.1f} s ({r.direct_rows_per_second:,.0f} "
                f"rows/s, {r.direct_ratio:.2f}x SQL)  database CPU "
                f"{cpu(r.direct_db_cpu_us_per_row)}"
            )
        lines.append(
            f"  same results: {'yes' if r.results_match else 'NO'}  peak RSS: driver "
            f"{r.driver_peak_rss_mb:.0f} MB, JVM {r.jvm_peak_rss_mb:.0f} MB, Python workers "
            f"{r.python_workers_peak_rss_mb:.0f} MB  (database CPU: the server's processes, "
            "from /proc)"
        )
        return "\n".join(lines)
