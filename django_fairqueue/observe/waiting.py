"""Why is this waiting? One sentence, computed from the scheduler's own state.

For a channel (the admin's channel page, ``fairqueue status CHANNEL``) and for a message (the
admin's message page), the first cause that applies, in the order the claim itself checks:

1. a message that is not waiting says what it is doing (running, finished);
2. delayed until T, or waiting to retry at T after a failed attempt;
3. its lease expired and it waits for the rescuer;
4. the channel is paused;
5. no live worker serves the channel (none at all, or none whose channel filters include it):
   checked before the limits, which hold nothing back while no worker claims;
6. the channel is at its cap (n of n running, the oldest since T);
7. the channel is rate limited until T;
7b. its channel group is at its cap (n of n running across the group), or rate limited until
   its next turn T;
8. otherwise its place: how many channels come before it in the round (and for a message, how
   many messages before it in its channel), with an estimate from the recent claim rate.

Every read is lock-free and bounded: the channel row and its pending deltas, two index range
counts, the worker registry and five minutes of statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django_fairqueue import conf
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.models import Message, MessageState
from django_fairqueue.observe import moments, overview
from django_fairqueue.queues import display_name, split_row_name
from django_fairqueue.runtime import worker_registry

#: The window of claims the estimate is based on (the statistics hold one row per minute).
RATE_MINUTES = 5


@dataclass(frozen=True)
class Why:
    """The answer: a cause (a short key, stable for tests and tools) and the sentence."""

    cause: str
    text: str

    def __str__(self) -> str:
        return self.text


def _when(moment: datetime, now: datetime) -> str:
    return overview.format_since(moment, now)


def channel(channel_id: int, *, views: list[worker_registry.WorkerView] | None = None) -> Why:
    """Why the ready messages of a channel wait (or that nothing does)."""
    state = channel_store.select_channel_wait_state(channel_id)
    if state is None:
        return Why("missing", "no such channel")
    if state.ready <= 0:
        if state.running > 0:
            views = worker_registry.workers(state.now) if views is None else views
            if not worker_registry.live(views):  # so its running messages are a dead worker's
                running = (
                    "its running message belongs to a stopped worker: it runs again once a "
                    "worker starts and its rescuer takes it back"
                    if state.running == 1
                    else f"its {state.running:,} running messages belong to a stopped worker: "
                    "they run again once a worker starts and its rescuer takes them back"
                )
                return Why("no_worker", f"no live worker: no ready message, and {running}")
        return _not_ready_yet(channel_id)
    return _channel_cause(channel_id, state, views)


def _not_ready_yet(channel_id: int) -> Why:
    """A channel without a ready message: its delayed and retrying ones, or nothing waits."""
    counters = channel_store.select_channel_counters([channel_id])
    scheduled = counters[0].scheduled if counters else 0
    if scheduled <= 0:
        return Why("empty", "nothing waits: the channel has no ready, delayed or retrying message")
    retrying = channel_store.select_channel_retrying([channel_id]).get(channel_id, 0)
    delayed = max(scheduled - retrying, 0)
    parts = [f"{delayed:,} delayed (sent to run later)"] if delayed else []
    if retrying:
        parts.append(f"{retrying:,} waiting to retry after a failed attempt")
    return Why(
        "delayed" if delayed else "retry",
        f"no message is ready yet: {' and '.join(parts)}; each becomes ready at its time",
    )


def _channel_cause(
    channel_id: int,
    state: channel_store.ChannelWaitState,
    views: list[worker_registry.WorkerView] | None,
) -> Why:
    now = state.now
    if state.paused:
        return Why("paused", "paused: none of its messages is claimed until it is resumed")
    # Before the limits: with no worker to claim, a cap or a rate limit holds nothing back
    # (and "the next starts when one finishes" would promise what cannot happen: the running
    # messages of a dead worker only end when a live worker's rescuer takes them back).
    views = worker_registry.workers(now) if views is None else views
    alive = worker_registry.live(views)
    if not alive:
        return Why("no_worker", "no live worker: nothing runs until one starts")
    if not any(_serves(v, state.name) for v in alive):
        return Why(
            "no_worker_for_channel",
            f"no live worker serves this channel: the {len(alive)} live ones are limited to "
            "other queues or channels (--queues / --channels / --exclude-channels)",
        )
    cap = state.max_concurrency
    if cap is not None and state.running >= cap:
        since = ""
        if state.oldest_running_since is not None:
            since = f", the oldest since {_when(state.oldest_running_since, now)}"
        return Why(
            "at_cap",
            f"at its cap: {state.running} of {cap} running{since}; the next starts when one "
            "finishes",
        )
    if state.release_interval > timedelta(0) and state.next_turn_at > now:
        return Why(
            "rate_limited",
            f"rate limited (one message every {state.release_interval.total_seconds():g}s): "
            f"its next release is at {_when(state.next_turn_at, now)}",
        )
    if state.group is not None:
        group = display_name(state.group)  # a group of another queue: "acme [reports]"
        gcap = state.group_max_concurrency
        if gcap is not None and state.group_running >= gcap:
            return Why(
                "group_at_cap",
                f"its channel group {group!r} is at its cap: {state.group_running} of {gcap} "
                "running across the group's channels; the next starts when one of them "
                "finishes",
            )
        turn = state.group_next_turn_at
        if turn is not None and turn > now:
            every = state.group_release_interval.total_seconds()
            return Why(
                "group_rate_limited",
                f"its channel group {group!r} is rate limited (one message every {every:g}s "
                f"across its channels): the group's next release is at {_when(turn, now)}",
            )
    rate = state.claimed_recently / (RATE_MINUTES * 60)
    if state.ahead == 0:
        return Why("next", "next in the round: the next claim of a free worker takes it")
    estimate = f"; at the recent rate of {rate:,.1f} messages/s" if rate > 0 else ""
    if rate > 0:
        estimate += f", about {overview.format_age(state.ahead / rate)}"
    return Why(
        "in_round",
        f"{state.ahead:,} channel{'s' if state.ahead != 1 else ''} ahead of it in the round"
        f"{estimate}",
    )


def _serves(view: worker_registry.WorkerView, row: str) -> bool:
    """Whether the worker of ``view`` claims from the channel row named ``row``: its queue is
    one the worker serves, and its name (within the queue) passes the channel filters."""
    queue, name = split_row_name(row)
    if view.queues is not None and queue not in view.queues:
        return False
    if view.channels:
        return name in view.channels
    return name not in view.exclude_channels


def message(msg: Message, *, views: list[worker_registry.WorkerView] | None = None) -> Why:
    """Why this message has not run yet (or what it is doing instead)."""
    if msg.state in (MessageState.SUCCEEDED, MessageState.FAILED, MessageState.CANCELLED):
        done = overview.format_time(msg.finished_at) if msg.finished_at else "?"
        return Why("finished", f"not waiting: {msg.state} at {done}")
    state = channel_store.select_channel_wait_state(msg.channel_id)
    if state is None:
        return Why("missing", "its channel no longer exists")
    now = state.now
    if msg.state == MessageState.RUNNING:
        expires = moments.aware(msg.lease_expires_at)  # (naive from the ORM without USE_TZ)
        if expires is not None and expires < now:
            every = conf.get().RESCUE_INTERVAL
            return Why(
                "lease_expired",
                f"its lease expired at {_when(expires, now)} (worker {msg.worker_id or '?'} "
                f"stopped renewing it): the rescuer of a live worker requeues it (every "
                f"{every:g}s)",
            )
        since = _when(msg.claimed_at, now) if msg.claimed_at else "?"
        return Why("running", f"not waiting: running on {msg.worker_id or '?'} since {since}")
    if msg.state == MessageState.SCHEDULED:
        if msg.attempts > 0:
            error = msg.last_error or {}
            what = f"{error.get('type', 'error')}: {error.get('message', '')}".strip(": ")
            return Why(
                "retry",
                f"waiting to retry at {_when(msg.run_at, now)} (attempt {msg.attempts} of "
                f"{msg.max_attempts} failed: {what})",
            )
        return Why("delayed", f"delayed until {_when(msg.run_at, now)}")
    cause = _channel_cause(msg.channel_id, state, views)
    ahead = message_store.select_messages_ahead(msg.channel_id, msg.priority, msg.pk)
    if ahead:
        noun = "message" if ahead == 1 else "messages"
        text = f"{ahead:,} {noun} of its channel ahead of it; the channel: {cause.text}"
        return Why(cause.cause, text)
    return cause
