"""Keep N worker processes running: ``runfairworker --processes N``.

A task that kills its process (``os._exit``, a segfault in a C extension, the OOM killer)
takes down the worker running it, and every retry of that task takes down another. Run under
a supervisor, each worker is a child process: one that dies is started again (after a backoff
that grows while it keeps dying young), so the rest of the fleet and the other tenants carry
on, and the killer task reaches its last attempt and becomes a dead letter.

* A child that dies (a non-zero exit status: a broken deployment or settings fail the
  command too; or a signal) is started again after an exponential backoff with jitter:
  ``RESTART_FIRST`` doubled per death in a row soon after the start, at most ``RESTART_CAP``,
  each delay drawn from its upper half so slots dying together do not restart together. One
  that lived ``STABLE_AFTER`` seconds starts its backoff over. A clean exit (0) is a recycle:
  replaced at once.
* ``CRASH_LOOP_AFTER`` young deaths in a row make a crash loop: logged as an error, with the
  slot's last exits, at every restart until a child lives long enough. Each slot keeps its
  last ``EXIT_HISTORY`` exits (code, lifetime, time), no more.

* The supervisor touches no database and imports no task: it only starts, watches and stops
  children, each a ``runfairworker`` of its own (with the same options, less the supervisor's).
* The first SIGTERM/SIGINT is forwarded to every child as a graceful stop (no more claims,
  running messages finish within ``--shutdown-grace``) and nothing is restarted any more; a
  second one is forwarded too, and the children exit at once.
* ``--max-tasks-per-child N`` recycles a child after N messages (a worker whose memory grows
  with every task): it exits ``RECYCLE_EXIT`` after its N-th message and a fresh one takes its
  place at once, in burst mode too.
* With ``--burst`` a child that exits 0 is done (nothing was left to run); one that died is
  started again, since its work is not; one that could not start (``STARTUP_FAILED_EXIT``: its
  worker id in use, its metrics port taken, its database refusing its settings) is not, since
  it would fail the same way: the burst ends when the others are done, with exit status 1.
* A child ignores a stop signal repeated within ``SAME_STOP_SECONDS`` of the first: a service
  manager that signals every process of the service (systemd's default ``KillMode``) reaches
  it directly and through this supervisor, and that is one stop, not two.

Why not a process manager (systemd, supervisord, Kubernetes)? Use one for the supervisor
itself; this loop only adds what they lack here: restarting each worker slot on its own with
a per-slot backoff, recycling by message count, and a clean two-step stop of the whole set.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue.runtime import (
    RECYCLE_EXIT,
    STARTUP_FAILED_EXIT,
    STOP_SIGNALS,
    SUPERVISION_ENV,
    StopFlag,
    stop_signals,
)
from django_fairqueue.worker import extensions

logger = logging.getLogger("django_fairqueue.supervisor")

#: Restart backoff for a child that died young: first, doubled while it keeps dying young, at
#: most cap (each delay drawn between half of it and all of it).
RESTART_FIRST = 1.0
RESTART_CAP = 60.0
#: A child that ran this long before dying was not crash-looping: its backoff starts over.
STABLE_AFTER = 60.0
#: Young exits in a row that make a crash loop (logged as an error at every restart).
CRASH_LOOP_AFTER = 3
#: Exits each slot remembers.
EXIT_HISTORY = 20
#: How often the supervisor looks at its children.
POLL = 0.2


@dataclass(frozen=True)
class Exit:
    """One child's end: its exit code (negative: the signal), how long it ran, when it ended."""

    code: int
    lived: float
    at: float  # time.time()


@dataclass
class Slot:
    """One worker position: the child running in it now, and its restart history."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    backoff: float = 0.0
    restarts: int = 0
    done: bool = False
    #: the last EXIT_HISTORY exits, oldest first
    exits: deque[Exit] = field(default_factory=lambda: deque(maxlen=EXIT_HISTORY))
    #: deaths in a row soon after the start (see STABLE_AFTER)
    young_exits: int = 0
    #: the pid of the slot's last child, reaped: proved gone, so the next child may take its
    #: worker id over at once although its registry row still looks alive
    predecessor_pid: int | None = None

    @property
    def crash_loop(self) -> bool:
        return self.young_exits >= CRASH_LOOP_AFTER

    def supervision(self) -> dict[str, object]:
        """What the next child records of its slot in the worker registry, and the pid of the
        child before it, whose worker id it takes over."""
        from django_fairqueue.runtime import worker_registry

        return {
            "slot": self.index,
            "restarts": self.restarts,
            "young_deaths": self.young_exits,
            "crash_loop": self.crash_loop,
            worker_registry.PREDECESSOR_PID: self.predecessor_pid,
            "exits": [
                {"how": _how(e.code), "lived": round(e.lived, 1), "at": round(e.at, 1)}
                for e in list(self.exits)[-CRASH_LOOP_AFTER:]
            ],
        }

    def exited(self, code: int, now: float) -> float:
        """Record the child's exit (``now``: time.monotonic()); returns the seconds to wait
        before starting the next one."""
        lived = now - self.started
        self.exits.append(Exit(code, lived, time.time()))
        if code == 0 or lived >= STABLE_AFTER:
            self.young_exits = 0
            self.backoff = 0.0
            return 0.0 if code == 0 else RESTART_FIRST  # a recycle, or a death after a while
        self.young_exits += 1
        self.backoff = RESTART_FIRST if self.backoff == 0 else min(RESTART_CAP, self.backoff * 2)
        return self.backoff * random.uniform(0.5, 1.0)


class Supervisor:
    """Run ``command_for(i)`` in ``processes`` slots until stopped (see the module docstring)."""

    def __init__(
        self,
        command_for: Callable[[int], Sequence[str]],
        processes: int,
        *,
        burst: bool = False,
        env: dict[str, str] | None = None,
        stop: StopFlag | None = None,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.command_for = command_for
        self.slots = [Slot(i) for i in range(processes)]
        self.burst = burst
        self.env = env
        self.stop = stop or StopFlag()
        self.signals = 0
        self.last_signal = 0
        #: a child exited otherwise than 0 while stopping (it had to exit at once, or died)
        self.unclean_stop = False

    def run(self) -> int:
        """Supervise until stopped (or, with burst, until every child is done).

        Returns 0 after a clean stop, 128 + the signal's number after a second signal (the
        children were told to exit at once, as a worker alone exits), 1 if a child did not
        stop cleanly (it exited at once, or died) or a burst child never finished cleanly.
        """
        with stop_signals(self._on_signal):
            for slot in self.slots:
                self._start(slot)
            while True:
                now = time.monotonic()
                for slot in self.slots:
                    self._check(slot, now)
                if all(slot.proc is None and (slot.done or self.stopping) for slot in self.slots):
                    break
                self.stop.wait(POLL)
        if self.signals >= 2:
            return 128 + self.last_signal
        if self.stopping:  # clean if every child that was running stopped cleanly
            return 1 if self.unclean_stop else 0
        clean = all(slot.exits[-1].code == 0 for slot in self.slots if slot.exits)
        return 0 if clean else 1

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        self.last_signal = signum
        self.stop.set()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                # The child counts signals as the worker does: the first is a graceful stop,
                # the second an immediate exit.
                slot.proc.send_signal(signal.SIGTERM)
        what = "stopping gracefully" if self.signals == 1 else "stopping now"
        logger.warning("supervisor: signal %s, %s", signal.Signals(signum).name, what)

    def _start(self, slot: Slot) -> None:
        command = list(self.command_for(slot.index))
        # A session of its own: Ctrl-C in a terminal signals the whole foreground group, and a
        # child that got it directly and again from us would take it as the second signal
        # (exit at once). The children hear signals from the supervisor only, and die with it.
        env = dict(self.env if self.env is not None else os.environ)
        env[SUPERVISION_ENV] = json.dumps(slot.supervision())
        slot.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        slot.started = time.monotonic()
        slot.restart_at = None
        logger.info("supervisor: worker %s started (pid %s)", slot.index, slot.proc.pid)

    def _check(self, slot: Slot, now: float) -> None:
        if slot.proc is None:
            if slot.restart_at is not None and now >= slot.restart_at and not self.stopping:
                self._start(slot)
            return
        code = slot.proc.poll()
        if code is None:
            return
        pid = slot.proc.pid
        slot.proc = None
        slot.predecessor_pid = pid  # poll() returned its status: reaped
        if self.stopping:
            slot.exits.append(Exit(code, now - slot.started, time.time()))
            # (killed by the stop signal itself: a child still starting, before its handlers)
            clean = code in (0, RECYCLE_EXIT) or -code in STOP_SIGNALS
            self.unclean_stop = self.unclean_stop or not clean
            logger.info("supervisor: worker %s (pid %s) stopped (%s)", slot.index, pid, _how(code))
            return
        if code == RECYCLE_EXIT:
            code = 0  # replaced at once, burst or not (a burst child's 0 is its burst done)
        elif code == 0 and self.burst:
            slot.exits.append(Exit(code, now - slot.started, time.time()))
            slot.done = True
            logger.info("supervisor: worker %s (pid %s) finished its burst", slot.index, pid)
            return
        elif code == STARTUP_FAILED_EXIT and self.burst:
            slot.exits.append(Exit(code, now - slot.started, time.time()))
            slot.done = True
            logger.error(
                "supervisor: worker %s (pid %s) could not start (its error above); not starting "
                "it again in a burst",
                slot.index,
                pid,
                extra={"outcome": "could_not_start"},
            )
            return
        lived = now - slot.started
        delay = slot.exited(code, now)
        slot.restarts += 1
        slot.restart_at = now + delay
        if code == 0:
            # recycled (after --max-tasks-per-child messages, or with threads stuck in
            # timed-out tasks): replaced at once
            logger.info(
                "supervisor: worker %s (pid %s) recycled; starting a fresh one", slot.index, pid
            )
        else:
            level, loop = logging.WARNING, ""
            if slot.crash_loop:
                level = logging.ERROR
                recent = list(slot.exits)[-CRASH_LOOP_AFTER:]
                loop = (
                    f"; crash loop: {slot.young_exits} deaths in a row soon after starting ("
                    + ", ".join(f"{_how(e.code)} after {e.lived:.1f}s" for e in recent)
                    + ")"
                )
            logger.log(
                level,
                "supervisor: worker %s (pid %s) died (%s) after %.1fs; restart %s in %.1fs%s",
                slot.index,
                pid,
                _how(code),
                lived,
                slot.restarts,
                delay,
                loop,
                extra={"outcome": "crash_loop" if loop else "died"},
            )
        if delay == 0:
            self._start(slot)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the supervisor dies, even by
    SIGKILL (elsewhere a no-op: an orphaned worker still stops on its own SIGTERM)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    if code == STARTUP_FAILED_EXIT:
        return f"exit status {code}: could not start"
    return f"exit status {code}"


def environment() -> dict[str, str]:
    """The children's environment: this process's, with the settings module it runs with and
    this supervisor's name (``host:pid``)."""
    from django.conf import settings

    from django_fairqueue.runtime import worker_registry

    env = dict(os.environ)
    # each child records this process as its supervisor (the admin groups them)
    env[worker_registry.SUPERVISOR_ENV] = worker_registry.supervisor_name()
    module = getattr(settings, "SETTINGS_MODULE", None)
    if module and "DJANGO_SETTINGS_MODULE" not in env:
        env["DJANGO_SETTINGS_MODULE"] = module
    return env


def invocation() -> list[str]:
    """How this process was started, up to and including ``runfairworker``: the children are
    started the same way (``python manage.py``, ``python -m django``, ``django-admin``)."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "runfairworker" in argv[1:]:
        end = argv.index("runfairworker", 1)
        return [sys.executable, *argv[1 : end + 1]]
    # called in process (call_command): Django's own entry point, with the settings in the env
    return [sys.executable, "-m", "django", "runfairworker"]


def child_flags(options: dict[str, Any]) -> list[str]:
    """The options of one supervised worker: this command's, less the supervisor's own."""
    flags = [
        "--concurrency",
        str(options["concurrency"]),
        "--batch-size",
        str(options["batch_size"]),
        "--prefetch",
        str(options["prefetch"]),
        "--shutdown-grace",
        str(options["shutdown_grace"]),
        "--max-abandoned-threads",
        str(options["max_abandoned_threads"]),
        "--verbosity",
        str(options["verbosity"]),
    ]
    for name in (
        "channels",
        "exclude_channels",
        "queues",
        "poll_interval",
        "lease",
        "burst_horizon",
        "pythonpath",
    ):
        if options.get(name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(options[name])]
    for name in ("burst", "no_listen", "no_maintenance", "traceback"):
        if options.get(name):
            flags.append(f"--{name.replace('_', '-')}")
    for extension in extensions.registered():
        flags += extension.child_flags(options)
    return flags
