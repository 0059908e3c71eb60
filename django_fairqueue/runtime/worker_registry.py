"""The worker registry: which workers are alive, what they run, and rescuing the dead ones.

Every worker registers in ``fairqueue_worker`` before it claims anything, beats every
``FAIRQUEUE['WORKER_HEARTBEAT']`` seconds (running count, last claim), and marks itself
stopped on a graceful stop. A worker whose beat is older than ``WORKER_DEAD_AFTER`` is dead:
the maintenance loop of any live worker (or ``fairqueue maintain``) marks it so and expires the
leases of the messages it was running, which the rescuer then takes back in the same pass, so a
killed worker's tenants resume after ``WORKER_DEAD_AFTER`` rather than after the full lease.

Registering also expires the leases still held under the same worker id: a process that has
not claimed yet holds none, so they belong to a previous process with that id (a supervised
worker restarted in its slot, a container restarted with a fixed ``--worker-id``).

That takeover is only safe when the previous process is gone: two live processes under one id
would each take the other's running messages back (the task runs twice at once) and mix their
rows. So a worker registers under an id only when the id's row is free: stopped or marked dead,
silent for ``WORKER_DEAD_AFTER`` (what the maintenance loop would declare dead anyway), or held
by a process proved gone, which is what keeps the restart of a killed worker immediate:

* its supervisor (``runfairworker --processes``) reaped it, and tells the slot's next child
  that pid (``SUPERVISION_ENV``, ``predecessor_pid``);
* it ran on this host under a pid no process has now (``os.kill(pid, 0)``; a pid taken since
  by another process only delays the takeover until the row is silent long enough);
* it ran on this host under this very pid, and no worker of this process beats under the id
  (a container restarted with its hostname, whose worker has pid 1 again; an embedding
  process that runs a new worker after the last one stopped).

Anything else, a worker on another host above all (its pid means nothing here), is live, and
the new process refuses to start (:class:`WorkerIdInUse`), naming it. The check and the write
are one conditional upsert (``register_worker``): of two processes registering one id at once,
the second finds the first's fresh row and is refused too. Hosts are told apart by hostname:
containers that share one and a pid namespace each would not be (give them distinct ids).

A worker started by a supervisor (``runfairworker --processes``) also records what the
supervisor knew of its slot when it started the process: how often the slot was restarted, and
whether it is in a crash loop (``SUPERVISION_ENV``), so ``fairqueue workers`` and the admin
show a crash loop next to the workers.

The registry is written only through :mod:`django_fairqueue.db.worker_store`; the admin shows it
read-only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pkgutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from django_fairqueue import __version__, conf, migrations
from django_fairqueue.db import pg, worker_store
from django_fairqueue.observe import moments
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    SUPERVISION_ENV,
    StopFlag,
    after_database_error,
    reset_connection,
)
from django_fairqueue.runtime.attempts import RESCUED

logger = logging.getLogger("django_fairqueue.runtime.worker_registry")

#: The version a worker registers, shown by ``fairqueue workers``: the release and the number of
#: the last migration its code needs ("0.1.0 (0038)"), which tells the workers of two commits of
#: one release apart during an upgrade.
_NEEDS = max(m.name[:4] for m in pkgutil.iter_modules(migrations.__path__) if m.name[:4].isdigit())
CODE_VERSION = f"{__version__} ({_NEEDS})"

#: The environment variable a ``runfairworker --processes`` supervisor gives its children:
#: its ``host:pid``, which each child records in its registry row.
SUPERVISOR_ENV = "FAIRQUEUE_SUPERVISOR"


#: The registrations beating in this process (their beat_until() runs), by worker id.
_beating: dict[str, Registration] = {}
_beating_lock = threading.Lock()

#: What SUPERVISION_ENV says of the child a supervisor reaped before starting this process.
PREDECESSOR_PID = "predecessor_pid"


class WorkerIdInUse(Exception):
    """A live process holds the worker id a worker was to register under."""

    def __init__(self, worker_id: str, holder: worker_store.Holder | None) -> None:
        self.worker_id = worker_id
        self.holder = holder  # None: other processes kept registering under it meanwhile
        by = (
            "other processes registering under it at the same time"
            if holder is None
            else f"a live worker on host {holder.host} pid {holder.pid}, last beat "
            f"{holder.silent_seconds:.0f}s ago"
        )
        super().__init__(
            f"worker id {worker_id} is in use by {by}; give each process its own --worker-id "
            f"(a worker silent for FAIRQUEUE['WORKER_DEAD_AFTER'] = "
            f"{conf.get().WORKER_DEAD_AFTER:g}s counts as dead, and its id is free again)"
        )


def supervisor_name() -> str:
    """How this process names itself as its children's supervisor: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Beat:
    """What a worker reports with each beat."""

    running: int
    handled: int
    last_claim_at: datetime | None


class Registration:
    """One worker process's row in the registry, from register() to deregister()."""

    def __init__(
        self,
        worker_id: str,
        *,
        concurrency: int,
        channels: Sequence[str] = (),
        exclude_channels: Sequence[str] = (),
        queues: Sequence[str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.channels = channels
        self.exclude_channels = exclude_channels
        self.queues = queues  # None: every queue
        self._status: Callable[[], Beat] | None = None  # while beat_until() runs
        #: when the last beat that landed was sent (time.monotonic()); registering beats
        self._beat_sent = 0.0
        #: when the last beat was tried, and when the last try ended, landed or not: a beat
        #: that failed for the database was still tried (the process was not held up)
        self._beat_started = self._beat_ended = -math.inf

    def register(self) -> int:
        """Record this worker as running; returns how many leases of a previous process with
        the same worker id it expired (the rescuer takes those messages back).

        Raises :class:`WorkerIdInUse`, having written nothing, if a live process holds the id
        (see the module docstring)."""
        dead_after = conf.get().WORKER_DEAD_AFTER
        holder = worker_store.select_worker_holder(self.worker_id, dead_after)
        orphaned = None
        # A refusal re-reads the holder: one that stopped meanwhile frees the id, one that
        # registered meanwhile is named. Three rounds: the id cannot keep changing hands.
        for _round in range(3):
            gone = holder is not None and _gone(self.worker_id, holder)
            if holder is not None and not gone:
                raise WorkerIdInUse(self.worker_id, holder)
            self._beat_sent = time.monotonic()  # (the row is stamped now)
            orphaned = worker_store.register_worker(
                self.worker_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                version=CODE_VERSION,
                concurrency=self.concurrency,
                channels=list(self.channels),
                exclude_channels=list(self.exclude_channels),
                queues=None if self.queues is None else list(self.queues),
                dead_after=dead_after,
                dead=holder if gone else None,
            )
            if orphaned is not None:
                break
            holder = worker_store.select_worker_holder(self.worker_id, dead_after)
        if orphaned is None:
            raise WorkerIdInUse(self.worker_id, holder)
        worker_store.set_worker_supervisor(self.worker_id, os.environ.get(SUPERVISOR_ENV, ""))
        if orphaned:
            logger.warning(
                "worker %s: expired %d leases a previous process with this id left behind",
                self.worker_id,
                orphaned,
                extra={"worker_id": self.worker_id},
            )
        supervision = _supervision()
        if supervision is not None:
            worker_store.record_worker_supervision(self.worker_id, supervision)
        return orphaned

    def beat_until(self, stop: StopFlag, status: Callable[[], Beat]) -> None:
        """Beat every WORKER_HEARTBEAT seconds until ``stop`` is set; a failed beat is logged
        and retried at the next one (missing a few does not make a worker dead).

        Meanwhile the worker is alive to this process's own maintenance passes, whatever its
        row says (:func:`rescue_dead_workers`)."""
        self._status = status
        with _beating_lock:
            _beating[self.worker_id] = self
        try:
            while not stop.wait(conf.get().WORKER_HEARTBEAT):
                self.beat(status())
        finally:
            with _beating_lock:
                if _beating.get(self.worker_id) is self:
                    del _beating[self.worker_id]

    def beat(self, now: Beat) -> None:
        sent = self._beat_started = time.monotonic()
        try:
            worker_store.beat_worker(
                self.worker_id,
                running=now.running,
                handled=now.handled,
                last_claim_at=now.last_claim_at,
            )
        except CONNECTION_ERRORS as exc:
            logger.warning("worker registry beat failed: %s", after_database_error(exc))
            return
        finally:
            self._beat_ended = time.monotonic()
        self._beat_sent = sent

    def beat_if_late(self) -> bool:
        """Beat now if no beat landed for two WORKER_HEARTBEAT periods or more; returns whether
        it beat. The row then looks dead to other workers although the worker runs again.

        That happens when something held up the whole process (a task holding the GIL, a
        pause): no beat was even tried, and that is logged. Beats that were tried and failed
        for the database were logged as they failed: nothing more is said of them."""
        status = self._status
        now = time.monotonic()
        period = conf.get().WORKER_HEARTBEAT
        late = now - self._beat_sent
        if status is None or late < 2 * period:
            return False
        # (a try under way, e.g. a connect waiting on an unreachable server, is a try too)
        trying = self._beat_started > self._beat_ended
        if not trying and now - self._beat_ended >= 2 * period:
            logger.warning(
                "worker %s: its registry beat is late (%.0fs since the last one: the whole "
                "process was held up); beating now",
                self.worker_id,
                late,
                extra={"worker_id": self.worker_id},
            )
        self.beat(status())
        return True

    def deregister(self, now: Beat) -> None:
        # Twice at most: an outage that ended during the stop left this thread's connection
        # broken (its last use failed), and the database is back for a fresh one.
        for last in (False, True):
            try:
                left = worker_store.deregister_worker(
                    self.worker_id, handled=now.handled, last_claim_at=now.last_claim_at
                )
                break
            except CONNECTION_ERRORS as exc:  # it will look dead after WORKER_DEAD_AFTER instead
                if not last:
                    reset_connection()
                    continue
                what = after_database_error(exc)
                logger.warning("worker registry: could not mark stopped: %s", what)
                return
        if left:
            logger.warning(
                "worker %s stopped with %d messages still running: their leases expired now, "
                "and the rescuer takes them back at its next pass (%s)",
                self.worker_id,
                left,
                RESCUED,
            )


def _gone(worker_id: str, holder: worker_store.Holder) -> bool:
    """Whether the process a live-looking row of ``worker_id`` names is proved gone (see the
    module docstring): only a process on this host can be."""
    if holder.host != socket.gethostname():
        return False
    if holder.pid == (_supervision() or {}).get(PREDECESSOR_PID):
        return True  # the supervisor reaped it
    if holder.pid == os.getpid():
        with _beating_lock:
            return worker_id not in _beating
    return not _pid_exists(holder.pid)


def _pid_exists(pid: int) -> bool:
    """Whether a process of this pid exists on this host (True when that cannot be told)."""
    if os.name != "posix" or pid <= 0:
        return True  # (elsewhere os.kill would end the process instead of probing it)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, another user's
        return True
    return True


def _supervision() -> dict[str, object] | None:
    """What this process's supervisor said of its slot, if it was started by one."""
    text = os.environ.get(SUPERVISION_ENV)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.warning("%s is not a JSON object; not recorded: %r", SUPERVISION_ENV, text[:200])
        return None
    return value


def wall_clock() -> datetime:
    """For last_claim_at, shown to operators only (no due time is computed from it)."""
    return datetime.now(UTC)


def rescue_dead_workers() -> list[worker_store.DeadWorker]:
    """Mark workers whose beat is older than WORKER_DEAD_AFTER dead and expire their leases.

    Never a worker of this process that still beats: its maintenance pass running proves it
    alive, however old its row (a task that held the GIL stopped its beat thread as well as
    this pass). A late one beats now instead, so other workers see it alive again."""
    with _beating_lock:
        here = list(_beating.values())
    for registration in here:
        registration.beat_if_late()
    dead = worker_store.expire_dead_workers(
        conf.get().WORKER_DEAD_AFTER, alive=[r.worker_id for r in here]
    )
    for worker in dead:
        n = worker.leases_expired
        # (0: its leases had run out already; the rescuer logs each message it takes back)
        leases = f"expired its {n} lease{'' if n == 1 else 's'}" if n else "no lease left to expire"
        logger.warning(
            "worker %s (%s pid %s) is dead: no beat for %.0fs; %s (the rescuer takes its "
            "messages back)",
            worker.worker_id,
            worker.host,
            worker.pid,
            worker.silent_seconds,
            leases,
            extra={"worker_id": worker.worker_id},
        )
    return dead


@dataclass(frozen=True)
class WorkerView:
    """One registry row as operators see it: alive means running with a recent beat."""

    worker_id: str
    host: str
    pid: int
    version: str
    state: str  # "alive", "silent" (beats late: dead soon), "dead" or "stopped"
    concurrency: int
    running: int
    handled: int
    channels: list[str]
    exclude_channels: list[str]
    started_at: datetime
    heartbeat_at: datetime
    last_claim_at: datetime | None
    #: the queues it claims from, in its order; None: every queue
    queues: list[str] | None = None
    #: how it learns of new messages: "notify", "polling: <why>", "" (unknown, --no-listen)
    wakeups: str = ""
    #: ``host:pid`` of the supervisor that started it ("" for none)
    supervisor: str = ""
    #: under a supervisor: how often its slot was restarted before this process, and whether
    #: the slot is in a crash loop (None: not supervised)
    restarts: int | None = None
    crash_loop: bool = False

    def as_dict(self) -> dict[str, object]:
        out = dict(self.__dict__)
        for key in ("started_at", "heartbeat_at", "last_claim_at"):
            value = out[key]
            out[key] = value.isoformat() if isinstance(value, datetime) else value
        return out


def workers(now: datetime | None = None) -> list[WorkerView]:
    """Every worker in the registry, live ones first, then by last beat.

    A beat's age is measured on the database's clock (``now`` defaults to it), the clock that
    stamped the beat and that the maintenance loop judges death by: a web server whose clock
    drifts from the database's then shows the same states the rescuer acts on.
    """
    from django_fairqueue.models import WorkerRecord

    cfg = conf.get()
    now = moments.aware(now or pg.select_clock(using=cfg.DATABASE))
    rows = []
    for w in WorkerRecord.objects.using(cfg.DATABASE).order_by("-heartbeat_at"):
        state = w.state
        heartbeat_at = moments.aware(w.heartbeat_at)  # naive from the ORM without USE_TZ
        if state == "running":
            silent = (now - heartbeat_at).total_seconds()
            state = "alive" if silent <= 3 * cfg.WORKER_HEARTBEAT else "silent"
            if silent > cfg.WORKER_DEAD_AFTER:
                state = "dead"  # not marked yet: no maintenance pass since
        rows.append(
            WorkerView(
                w.worker_id,
                w.host,
                w.pid,
                w.version,
                state,
                w.concurrency,
                w.running if state in ("alive", "silent") else 0,
                w.handled,
                list(w.channels or []),
                list(w.exclude_channels or []),
                moments.aware(w.started_at),
                heartbeat_at,
                moments.aware(w.last_claim_at),
                list(w.queues) if w.queues is not None else None,
                w.wakeups,
                w.supervisor,
                *supervised_restarts(w.supervision),
            )
        )
    order = {"alive": 0, "silent": 1, "dead": 2, "stopped": 3}
    return sorted(rows, key=lambda r: order.get(r.state, 4))


def supervised_restarts(supervision: object) -> tuple[int | None, bool]:
    """A registry row's supervision as (restarts, crash loop); (None, False): unsupervised."""
    if not isinstance(supervision, dict):
        return None, False
    restarts = supervision.get("restarts")
    return (
        restarts if isinstance(restarts, int) else None,
        supervision.get("crash_loop") is True,
    )


def restarts_text(restarts: int | None, crash_loop: bool) -> str:
    """A supervised worker's restarts as operators read them: ``"3"``, ``"7, crash loop"``;
    ``"-"`` for a worker no supervisor started."""
    if restarts is None:
        return "-"
    return f"{restarts}, crash loop" if crash_loop else str(restarts)


def queues_text(queues: Sequence[str] | None) -> str:
    """How a worker's queues read for operators: ``"all"`` or the names, comma-separated."""
    return "all" if queues is None else ", ".join(queues)


def live(views: list[WorkerView]) -> list[WorkerView]:
    return [v for v in views if v.state in ("alive", "silent")]
