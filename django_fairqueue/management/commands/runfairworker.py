"""``manage.py runfairworker``: run a django-fairqueue worker (see django_fairqueue.worker)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from types import ModuleType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from django_fairqueue import conf, limits
from django_fairqueue.api import validate_channel_name
from django_fairqueue.cli.terminal import printable
from django_fairqueue.exceptions import InvalidChannel
from django_fairqueue.management.base import FairCommand
from django_fairqueue.queues import parse_queue_list
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    RECYCLE_EXIT,
    STARTUP_FAILED_EXIT,
    SUPERVISION_ENV,
    command_logging,
    dbfaults,
    stop_signals,
)
from django_fairqueue.runtime.attempts import RESCUED
from django_fairqueue.runtime.worker_registry import WorkerIdInUse
from django_fairqueue.tasks.spec import registry
from django_fairqueue.worker import (
    Worker,
    WorkerConfig,
    WorkerCrashed,
    default_worker_id,
    extensions,
)
from django_fairqueue.worker.config import (
    BURST_HORIZON,
    MAX_ABANDONED_THREADS,
    MAX_BATCH,
    MAX_BURST_HORIZON,
    MAX_CONCURRENCY,
)

#: Most worker processes under one supervisor.
MAX_PROCESSES = 256
#: Longest --lease (limits.MIN_LEASE the shortest), and of the other durations: a day.
MAX_SECONDS = limits.MAX_LEASE
#: Highest TCP port, and the address --metrics-port binds by default (as
#: metrics.start_http_server does: that endpoint has no access control of its own).
MAX_PORT = 65_535
METRICS_ADDR = "127.0.0.1"


def _names(value: str | None, option: str) -> tuple[str, ...]:
    """The channel names of a comma-separated option, each checked as the API checks a name
    (so ``' a'``, with a blank no channel name can have, is refused, not trimmed). A channel
    whose name contains a comma cannot be named here."""
    if value is None:
        return ()
    names = value.split(",")
    for name in names:
        if not name:
            raise CommandError(
                f"{option} has an empty channel name in {value!r}; "
                "give a comma-separated list such as --channels alice,bob"
            )
        try:
            validate_channel_name(name)
        except InvalidChannel as exc:
            raise CommandError(f"{option}: {exc}") from exc
    return tuple(dict.fromkeys(names))


def _seconds(
    options: dict[str, Any], key: str, low: float, high: float, *, above: bool = False
) -> float | None:
    """A float option within low..high (above: strictly above ``low``); NaN and infinity are
    refused as well, since a sleep or a timedelta cannot take them."""
    value = options[key]
    if value is None:
        return None
    option = "--" + key.replace("_", "-")
    if not (low < value if above else low <= value) or not value <= high:
        span = f"above {low:g}" if above else f"{low:g}"
        raise CommandError(f"{option} must be {span} to {high:g} seconds, got {value}")
    return float(value)


def _count(options: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value: int | None = options[key]
    if value is not None and not low <= value <= high:
        option = "--" + key.replace("_", "-")
        if value < low:
            raise CommandError(f"{option} must be at least {low}, got {value}")
        raise CommandError(f"{option} must be at most {high:,}, got {value:,}")
    return value


class Command(FairCommand):
    help = (
        "Run a worker: claim messages fairly across channels and run their tasks on a pool of "
        "threads. The first SIGTERM/SIGINT stops claiming and lets running messages finish; a "
        "second one exits at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--concurrency",
            type=int,
            default=4,
            help="Handler threads: messages run at once by this process "
            f"(1 to {MAX_CONCURRENCY:,}; default 4).",
        )
        parser.add_argument(
            "--channels",
            metavar="NAMES",
            help="Claim only from these channels (comma-separated, taken as written: no blanks "
            "around the commas; they need not exist yet). A channel whose name contains a "
            "comma cannot be named here.",
        )
        parser.add_argument(
            "--exclude-channels",
            metavar="NAMES",
            help="Never claim from these channels (comma-separated, as --channels).",
        )
        parser.add_argument(
            "--queues",
            metavar="NAMES",
            help="Claim only from these queues (comma-separated, e.g. reports,exports; "
            "default: every queue), in turn, fairly across the channels within each. "
            "--channels and --exclude-channels apply within them.",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=100,
            help="Most messages one claim takes; a claim never exceeds the free threads "
            "plus --prefetch (default 100).",
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            default=0,
            help="Messages to claim beyond the free threads, started as threads free up: "
            "larger claims for short tasks, at the cost of holding them here (default 0).",
        )
        parser.add_argument(
            "--poll-interval",
            type=float,
            metavar="SECONDS",
            help="Claim at least this often when no wake-up arrives "
            "(default FAIRQUEUE['POLL_INTERVAL']).",
        )
        parser.add_argument(
            "--burst",
            action="store_true",
            help="Run what is ready, then exit 0 once nothing is ready or running and nothing "
            "is due within the burst horizon.",
        )
        parser.add_argument(
            "--burst-horizon",
            type=float,
            default=BURST_HORIZON,
            metavar="SECONDS",
            help="With --burst: also wait for work due within this many seconds (a "
            "rate-limited channel's next turn, a retry, a delayed message); 0 waits for none "
            f"(default {BURST_HORIZON:g}).",
        )
        parser.add_argument(
            "--max-messages",
            type=int,
            metavar="N",
            help="Exit 0 after claiming and finishing N messages.",
        )
        parser.add_argument(
            "--worker-id",
            help="Name recorded on claimed messages (default host:pid:random; keep it unique).",
        )
        parser.add_argument(
            "--shutdown-grace",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="On SIGTERM, how long the stop may take: running messages finishing, and "
            "their outcomes written through a database outage (default 30).",
        )
        parser.add_argument(
            "--lease",
            type=float,
            metavar="SECONDS",
            help="Lease of each claim, renewed by heartbeats (default FAIRQUEUE['LEASE_SECONDS']).",
        )
        parser.add_argument(
            "--max-abandoned-threads",
            type=int,
            default=MAX_ABANDONED_THREADS,
            metavar="N",
            help="Recycle the worker once N handler threads are stuck in tasks past their time "
            "limit (each is replaced, since Python cannot stop a thread): claim nothing more, "
            "finish the running messages, exit 0 for a process manager or --processes to "
            "restart it; one thread stuck longer than FAIRQUEUE['STUCK_TASK_LIMIT'] does too "
            f"(default {MAX_ABANDONED_THREADS}).",
        )
        parser.add_argument(
            "--no-listen",
            action="store_true",
            help="Do not LISTEN for wake-ups; poll only (behind a transaction-pooling proxy).",
        )
        parser.add_argument(
            "--processes",
            type=int,
            default=1,
            metavar="N",
            help="Run N worker processes (each with --concurrency threads) under a supervisor "
            "that restarts any that dies, with a growing backoff: a task that kills its process "
            "(os._exit, a segfault, the OOM killer) takes down one worker, not the fleet "
            "(default 1: this process is the worker).",
        )
        parser.add_argument(
            "--max-tasks-per-child",
            type=int,
            metavar="N",
            help="With a supervisor: replace each worker process after it handled N messages "
            "(for tasks whose memory grows). Implies the supervisor even with --processes 1.",
        )
        parser.add_argument(
            "--no-maintenance",
            action="store_true",
            help="Do not run the maintenance services here (rescuer, pruners, delta folder, "
            "counter verifier, scheduler): run `manage.py fairqueue maintain` somewhere instead.",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="Serve this worker process's own metrics (the claim latency histogram) to "
            "Prometheus on PORT; with --processes N, worker i serves PORT+i. Needs the "
            "prometheus extra (pip install django-fairqueue[prometheus]). No access control: "
            "keep it private.",
        )
        parser.add_argument(
            "--metrics-addr",
            metavar="ADDRESS",
            help=f"Address the --metrics-port server binds (default {METRICS_ADDR}; 0.0.0.0 "
            "for a scraper on another host).",
        )
        for extension in extensions.registered():  # options of installed apps' companions
            extension.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        config = self._config(options)
        metrics_at = _metrics_endpoint(options)
        for module, exc in registry.import_task_modules():
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            if missing is None or not (module == missing or module.startswith(missing + ".")):
                raise exc  # the module exists and its import failed: its own traceback
            raise CommandError(
                f"FAIRQUEUE['TASK_MODULES'] names {module!r}, which cannot be imported: {exc} "
                "(manage.py check reports it as fairqueue.E005)"
            ) from None
        with command_logging(options["verbosity"]):
            if options["processes"] > 1 or options["max_tasks_per_child"] is not None:
                self._supervise(options, metrics_at)
            else:
                self._work(options, config, metrics_at)

    def _work(
        self, options: dict[str, Any], config: WorkerConfig, metrics_at: tuple[str, int] | None
    ) -> None:
        metrics_server = None
        companions: list[extensions.Companion] = []
        try:
            try:
                # the supervisor above claims nothing: only a worker process serves claim
                # metrics
                if metrics_at is not None:
                    metrics_server = _serve_metrics(*metrics_at)
                companions = self._start_companions(options, config)
                # (a supervisor checked before its children, unless the database was
                # unavailable)
                checked = os.environ.get(MIGRATIONS_CHECKED_ENV) == "1" or _require_migrated()
                # unchecked: the worker checks once the database answers, before it registers
                worker = Worker(config, before_register=None if checked else _require_migrated_now)
                handled = worker.run()
            except (CommandError, WorkerIdInUse) as exc:
                # Could not start (run() raises these only before it registers): started
                # again, it would fail the same way; a supervisor is told so.
                code = STARTUP_FAILED_EXIT if SUPERVISION_ENV in os.environ else 1
                raise CommandError(str(exc), returncode=code) from exc
            except WorkerCrashed as exc:
                raise CommandError(str(exc)) from exc
            if config.burst:  # the companions' work is part of the burst: let them finish
                with stop_signals(lambda signum: _stop(companions)):
                    for companion in companions:
                        companion.finish()
        finally:
            _stop(companions)
            _stop_serving(metrics_server)
        if options["verbosity"] >= 1:
            self.stderr.write(f"worker {printable(config.worker_id)}: {handled} messages handled")
        if worker.unwritten:  # exit 1: a supervisor counts the stop as unclean, or restarts it
            raise CommandError(
                f"worker {printable(config.worker_id)} did not stop cleanly: {worker.unwritten} "
                "messages ran but their outcomes were not written (the database was unavailable "
                "until the grace period ended); the rescuer takes them back once their leases "
                f"expire ({RESCUED})"
            )
        if worker.wants_replacing and SUPERVISION_ENV in os.environ:
            # to a supervisor, 0 from a burst worker means its burst is done: say "replace me"
            sys.exit(RECYCLE_EXIT)

    def _supervise(self, options: dict[str, Any], metrics_at: tuple[str, int] | None) -> None:
        from django_fairqueue.worker import supervisor

        processes = options["processes"]
        recycle = options["max_tasks_per_child"]
        if recycle is not None and recycle < 1:
            raise CommandError(f"--max-tasks-per-child must be at least 1, got {recycle}")
        if options["max_messages"] is not None:
            raise CommandError(
                "--max-messages with a supervisor: use --max-tasks-per-child (each process "
                "is replaced after that many messages)"
            )
        # before any child (each would stop on it, again and again); with the database
        # unavailable now, each child checks once it answers
        checked = _require_migrated()
        prefix = supervisor.invocation()
        flags = supervisor.child_flags(options)
        # Each slot keeps its id across restarts: a child started again in a slot whose child
        # was killed expires the dead one's leases as it registers, instead of leaving its
        # messages until the dead worker is noticed (WORKER_DEAD_AFTER). Unique per supervisor.
        base_id = options["worker_id"] or default_worker_id()

        def command_for(index: int) -> list[str]:
            own = ["--worker-id", f"{base_id}-{index}"]
            more = ["--max-messages", str(recycle)] if recycle is not None else []
            if metrics_at is not None:  # a port per slot, kept across restarts
                addr, port = metrics_at
                more += ["--metrics-addr", addr, "--metrics-port", str(port + index)]
            return [*prefix, *flags, *own, *more]

        env = supervisor.environment()
        if checked:
            env[MIGRATIONS_CHECKED_ENV] = "1"
        code = supervisor.Supervisor(command_for, processes, burst=options["burst"], env=env).run()
        if code > 128:  # a second signal: every process told to exit at once
            sys.exit(code)
        if code:
            raise CommandError("a worker process did not stop cleanly", returncode=code)

    def _config(self, options: dict[str, Any]) -> WorkerConfig:
        concurrency = _count(options, "concurrency", 1, MAX_CONCURRENCY)
        batch_size = _count(options, "batch_size", 1, MAX_BATCH)
        prefetch = _count(options, "prefetch", 0, MAX_BATCH)
        _count(options, "processes", 1, MAX_PROCESSES)
        max_messages = _count(options, "max_messages", 1, limits.MAX_ID)
        _count(options, "max_tasks_per_child", 1, limits.MAX_ID)
        abandoned = _count(options, "max_abandoned_threads", 1, MAX_CONCURRENCY)
        poll = _seconds(options, "poll_interval", 0, limits.MAX_POLL_INTERVAL, above=True)
        grace = _seconds(options, "shutdown_grace", 0, MAX_SECONDS)
        horizon = _seconds(options, "burst_horizon", 0, MAX_BURST_HORIZON)
        lease = _seconds(options, "lease", limits.MIN_LEASE, MAX_SECONDS)
        assert concurrency is not None and batch_size is not None and prefetch is not None
        assert abandoned is not None and grace is not None and horizon is not None
        worker_id = options["worker_id"]
        if worker_id is not None and (not worker_id.strip() or len(worker_id) > 200):
            raise CommandError("--worker-id must be 1 to 200 characters, not blank")
        channels = _names(options["channels"], "--channels")
        exclude = _names(options["exclude_channels"], "--exclude-channels")
        both = sorted(set(channels) & set(exclude))
        if both:
            raise CommandError(f"channels both in --channels and --exclude-channels: {both}")
        queues = None
        if options.get("queues") is not None:
            try:
                queues = parse_queue_list(options["queues"])
            except InvalidChannel as exc:
                raise CommandError(f"--queues: {exc}") from exc
        try:
            return WorkerConfig(
                concurrency=concurrency,
                channels=channels,
                exclude_channels=exclude,
                queues=queues,
                batch_size=batch_size,
                prefetch=prefetch,
                poll_interval=poll,
                burst=options["burst"],
                burst_horizon=horizon,
                max_messages=max_messages,
                worker_id=worker_id or default_worker_id(),
                lease=timedelta(seconds=lease) if lease is not None else None,
                shutdown_grace=grace,
                max_abandoned_threads=abandoned,
                listen=not options["no_listen"] and conf.get().NOTIFY,
                maintenance=not options["no_maintenance"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc

    def _start_companions(
        self, options: dict[str, Any], config: WorkerConfig
    ) -> list[extensions.Companion]:
        """Start what installed apps run beside the worker (see worker/extensions.py)."""
        started: list[extensions.Companion] = []
        try:
            for extension in extensions.registered():
                try:
                    companion = extension.start(options, config)
                except ValueError as exc:
                    raise CommandError(str(exc)) from None
                if companion is not None:
                    started.append(companion)
        except BaseException:
            _stop(started)
            raise
        return started


def _metrics_endpoint(options: dict[str, Any]) -> tuple[str, int] | None:
    """``(address, port)`` of ``--metrics-port`` (the first worker's, under a supervisor), or
    None. The metrics module is imported here, so that a missing prometheus extra stops the
    command before anything starts."""
    addr = options.get("metrics_addr")
    port = _count(options, "metrics_port", 1, MAX_PORT)
    if port is None:
        if addr is not None:
            raise CommandError("--metrics-addr needs --metrics-port")
        return None
    processes = options["processes"]
    if port + processes - 1 > MAX_PORT:
        raise CommandError(
            f"--metrics-port {port} with --processes {processes}: the last worker would serve "
            f"port {port + processes - 1}, past {MAX_PORT}"
        )
    if addr is not None and not addr.strip():
        raise CommandError("--metrics-addr must be an address, such as 127.0.0.1 or 0.0.0.0")
    _metrics()
    return (addr or METRICS_ADDR, port)


def _metrics() -> ModuleType:
    try:
        from django_fairqueue import metrics
    except ImproperlyConfigured as exc:  # without the prometheus extra: its install line
        raise CommandError(f"--metrics-port: {exc}") from None
    return metrics


def _serve_metrics(addr: str, port: int) -> Any:
    """Start serving this process's metrics; returns the server, for :func:`_stop_serving`."""
    try:
        server, _thread = _metrics().start_http_server(port, addr=addr)
    except OSError as exc:  # the port is taken, the address is not this host's
        raise CommandError(
            f"--metrics-port: cannot serve metrics on {addr}:{port}: {exc.strerror or exc}"
        ) from None
    return server


def _stop_serving(server: Any) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def _stop(companions: list[extensions.Companion]) -> None:
    """Stop the companions, last started first."""
    for companion in reversed(companions):
        companion.stop()


#: Set for a supervisor's children when it found the queue's migrations all applied.
MIGRATIONS_CHECKED_ENV = "FAIRQUEUE_MIGRATIONS_CHECKED"


def _require_migrated() -> bool:
    """Refuse to start on a queue database that lacks some of this release's migrations
    (deployed before ``migrate`` ran): its statements would fail on columns and functions the
    database does not have yet, and the worker (each child of a supervisor, again and again)
    would stop with a database error instead of saying what to do. Returns False, unchecked,
    when the database cannot be reached now (:func:`_require_migrated_now` is then run once
    it answers)."""
    try:
        _require_migrated_now()
    except CONNECTION_ERRORS as exc:
        refused = dbfaults.misconfigured(exc)
        if refused:  # not an outage: a worker would wait for ever (and a burst then exit 0)
            alias = conf.get().DATABASE
            raise CommandError(
                f"the queue's database ({alias!r}) refused the connection: {refused}; "
                "check its settings (DATABASES, or DATABASE_URL): waiting will not change that"
            ) from exc
        return False
    return True


def _require_migrated_now() -> None:
    """:func:`_require_migrated`, a connection error raised (the worker retries it as it
    retries registering)."""
    from django.db import connections
    from django.db.migrations.executor import MigrationExecutor

    alias = conf.get().DATABASE
    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes("fairqueue"))
    missing = [m.name for m, _backwards in plan if m.app_label == "fairqueue"]
    if missing:
        database = "" if alias == "default" else f" --database {alias}"
        raise CommandError(
            f"the queue's database ({alias!r}) lacks {len(missing)} of django-fairqueue's "
            f"migrations (the first: {missing[0]}): run `manage.py migrate{database}` before "
            'starting workers of this release (docs/howto/deploy-workers.md, "Upgrading")'
        )
