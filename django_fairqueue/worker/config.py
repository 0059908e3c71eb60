"""A worker's settings, its tunable constants, and the records its parts pass each other."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from django_fairqueue import limits
from django_fairqueue.api import check_channel_in_queue, validate_channel_name
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.exceptions import FairQueueError, InvalidChannel
from django_fairqueue.queues import validate_queue_name
from django_fairqueue.tasks.spec import TaskSpec

logger = logging.getLogger("django_fairqueue.worker")


#: Most outcomes written by one settle statement, and leases renewed by one heartbeat.
SETTLE_BATCH = 1000
HEARTBEAT_BATCH = 5000
#: Seconds between two writes of the per-channel statistics (django_fairqueue.stats).
STATS_FLUSH_SECONDS = 5.0
#: After an empty claim a worker claims again this long after the next work's due time (the
#: database's figure), so the claim's clock is past it; and, when work was claimable yet the
#: claim got none (another transaction held it), it waits DUE_RETRY_FIRST doubled per empty
#: claim in a row, at most the poll interval.
DUE_SLACK = 0.002
DUE_RETRY_FIRST = 0.005
#: With a backlog, a claim waits up to this long (seconds) for half a batch of free slots
#: instead of claiming for each slot as it frees: one claim costs about as much for 1 message
#: as for 50, so short tasks would otherwise spend the database on tiny claims.
GATHER_SECONDS = 0.005
#: A burst worker is done once nothing is ready and nothing is due within this many seconds:
#: it waits for a rate-limited channel's next turn, and for retries and delayed messages due
#: that soon, rather than leave them behind (``WorkerConfig.burst_horizon``).
BURST_HORIZON = 5.0
MAX_BURST_HORIZON = 86_400.0
#: Stuck handler threads (tasks past their time limit) after which a worker recycles itself.
MAX_ABANDONED_THREADS = 10
#: Most messages one claim takes (``batch_size``), and most prefetched.
MAX_BATCH = 10_000
#: Most handler threads one worker process runs: past a few hundred, threads add contention,
#: not throughput (run more processes), and the system refuses to start millions of them.
MAX_CONCURRENCY = 1000

#: The clock leases are estimated with: monotonic, and on Linux counting time suspended too (a
#: machine that slept past a lease must see it expired). Never compared with the database's
#: clock: a lease's local deadline is this clock when the statement that set the lease was
#: sent, plus the lease (the database's expiry minus its time of that statement).
lease_clock: Callable[[], float] = (
    functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME")
    else time.monotonic
)

OutcomeKind = Literal["succeeded", "retry", "failed", "released", "aborted"]
STATS_OUTCOME: dict[str, Literal["succeeded", "failed", "retried"]] = {
    "succeeded": "succeeded",
    "retry": "retried",
    "failed": "failed",
}


class WorkerCrashed(FairQueueError):
    """A thread of the worker failed unexpectedly; the worker stopped."""


def default_worker_id() -> str:
    """``host:pid:random``: unique per process, so a restarted worker never hides its orphans."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker runs. ``None`` fields fall back to the FAIRQUEUE settings."""

    #: Handler threads: how many messages run at once in this process.
    concurrency: int = 4
    #: Claim only from these channels (names; channels created later are picked up).
    channels: Sequence[str] = ()
    #: Never claim from these channels.
    exclude_channels: Sequence[str] = ()
    #: Claim only from these queues (None: every queue), in turn, fairly across the channels
    #: within each; channel filters apply within them (docs/howto/queues.md).
    queues: Sequence[str] | None = None
    #: Most messages one claim takes (a claim never takes more than the free handler slots,
    #: plus ``prefetch``).
    batch_size: int = 100
    #: Messages to claim beyond the free handler threads, started as threads free up (opt-in).
    #: Claims then stay large when tasks are short: a claim costs the database about as much
    #: for 50 messages as for 5. Prefetched messages are leased (heartbeats renew them), count
    #: against their channel's ``max_concurrency`` and wait here rather than in the queue,
    #: where another worker could have started them; a graceful stop gives them back.
    prefetch: int = 0
    #: Seconds between claims when no wake-up arrives; None: FAIRQUEUE['POLL_INTERVAL'].
    poll_interval: float | None = None
    #: Stop once nothing is ready, nothing is running and nothing is due within
    #: ``burst_horizon`` seconds.
    burst: bool = False
    #: In burst mode, work due within this many seconds is waited for: a rate-limited
    #: channel's next turn (it has ready messages), a retry or a delayed message. 0: none.
    burst_horizon: float = BURST_HORIZON
    #: Stop after claiming this many messages (and finishing them).
    max_messages: int | None = None
    worker_id: str = field(default_factory=default_worker_id)
    #: Lease of each claim, renewed by heartbeats; None: FAIRQUEUE['LEASE_SECONDS'].
    lease: timedelta | None = None
    #: Seconds a graceful stop waits for running messages before leaving them to their leases.
    shutdown_grace: float = 30.0
    #: LISTEN for enqueue wake-ups (only when FAIRQUEUE['NOTIFY'] is on). Off behind a
    #: transaction-pooling proxy, where LISTEN does not work: polling alone then.
    listen: bool = True
    #: Run the rescuer, pruner and delta folder in this process.
    maintenance: bool = True
    #: Handler threads left stuck in tasks past their time limit (Python cannot stop a thread;
    #: each was replaced by a new one) at which the worker recycles itself: it claims nothing
    #: more, finishes the running messages and exits normally, for a process manager or
    #: ``runfairworker --processes`` to start a fresh process (one thread stuck longer than
    #: ``FAIRQUEUE['STUCK_TASK_LIMIT']`` recycles it too).
    max_abandoned_threads: int = MAX_ABANDONED_THREADS

    def __post_init__(self) -> None:
        # Within the command's ranges (--concurrency, --batch-size, ...); TypeError for what is
        # not an int, or not a bool for the switches.
        limits.integer(self.concurrency, "concurrency", minimum=1, maximum=MAX_CONCURRENCY)
        limits.integer(self.batch_size, "batch_size", minimum=1, maximum=MAX_BATCH)
        limits.integer(self.prefetch, "prefetch", minimum=0, maximum=MAX_BATCH)
        limits.integer(
            self.max_abandoned_threads, "max_abandoned_threads", minimum=1, maximum=MAX_CONCURRENCY
        )
        if self.max_messages is not None:
            limits.integer(self.max_messages, "max_messages", minimum=1, maximum=limits.MAX_LIMIT)
        for switch in ("burst", "listen", "maintenance"):
            if not isinstance(getattr(self, switch), bool):
                raise TypeError(f"{switch} must be True or False, got {getattr(self, switch)!r}")
        # Durations as runfairworker takes them (--poll-interval, --lease, --burst-horizon,
        # --shutdown-grace), in seconds except the lease, a timedelta.
        if self.poll_interval is not None:
            limits.seconds(
                self.poll_interval, "poll_interval", minimum=0.001, maximum=limits.MAX_POLL_INTERVAL
            )
        if self.lease is not None:
            # (shorter than the command's 5 s floor allowed, as the setting allows it with a
            # warning: tests of leases run on short ones)
            limits.lease(self.lease, minimum=0.001)
        limits.seconds(self.burst_horizon, "burst_horizon", minimum=0, maximum=MAX_BURST_HORIZON)
        limits.seconds(self.shutdown_grace, "shutdown_grace", minimum=0, maximum=limits.MAX_LEASE)
        limits.worker_id(self.worker_id)
        for attr in ("channels", "exclude_channels"):
            names = getattr(self, attr)
            limits.not_one_name(names, attr, "channel")
            object.__setattr__(self, attr, tuple(validate_channel_name(n) for n in names))
        both = sorted(set(self.channels) & set(self.exclude_channels))
        if both:
            raise ValueError(f"channels both included and excluded: {both}")
        if self.queues is not None:
            limits.not_one_name(self.queues, "queues", "queue")
            queues = tuple(dict.fromkeys(validate_queue_name(q) for q in self.queues))
            if not queues:
                raise ValueError("queues must name at least one queue (None: every queue)")
            object.__setattr__(self, "queues", queues)
            for name in self.channels:
                _in_some_queue(name, queues)


def _in_some_queue(name: str, queues: Sequence[str]) -> None:
    """Refuse a channel no enqueue can create in any of ``queues`` (a queue's name is part of
    its channels' row names, which must fit): the worker would wait for it for ever."""
    refusals = []
    for queue in queues:
        try:
            check_channel_in_queue(name, queue)
            return
        except InvalidChannel as exc:
            refusals.append(f"{queue}: {exc}")
    raise InvalidChannel(
        f"channel {name!r} cannot be in any of the queues served ({'; '.join(refusals)})"
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one claimed message, waiting to be written."""

    message: ClaimedMessage
    kind: OutcomeKind
    result: Any = None
    error: dict[str, Any] | None = None
    #: backoff before the next attempt; the database adds it to its own clock
    retry_in: timedelta | None = None
    duration: float = 0.0
    #: a failed attempt that ran past its time limit (counted as a timeout, not a failure)
    timed_out: bool = False


@dataclass(eq=False)
class Attempt:
    """A running attempt, under its time limit if it has one (compared by identity: a message
    id comes back with its retries)."""

    message: ClaimedMessage
    spec: TaskSpec
    thread: threading.Thread
    timeout: float | None  # None: no time limit
    started: float  # time.monotonic()
    #: Set by the timer (under the worker's lock) when the limit passed: the attempt failed as
    #: timed out, and its thread no longer belongs to the pool. Its outcome (``parked``) is
    #: written only once the thread returns (``returned``): until then its lease is renewed
    #: and its channel's cap counts it, so its retry never runs beside it.
    abandoned: bool = False
    abandoned_at: float = 0.0  # time.monotonic()
    parked: Outcome | None = None
    returned: bool = False
    #: Set (under the worker's lock) when a heartbeat found an abort requested: the task's
    #: abort_requested() turns True, and the attempt ends aborted by ``abort_at`` at the latest.
    abort_seen: bool = False
    abort_at: float | None = None

    @property
    def deadline(self) -> float:
        limit = self.started + self.timeout if self.timeout is not None else float("inf")
        return min(limit, self.abort_at) if self.abort_at is not None else limit

    def aborting(self) -> bool:
        """Whether an abort was requested (a read of one flag: no lock needed)."""
        return self.abort_seen

    def passed(self) -> bool:
        """Whether the limit has passed (a read of one flag: no lock needed)."""
        return self.abandoned


# ------------------------------------------------------------------------------------------------
