"""Channels and channel groups: creation, names and their locks, counters, limits and
scheduler state.

A channel row holds what operators edit (``models.Channel``); its hot state and counters live
where only the SQL functions write them. Reads here sum a channel's counters with its deltas
not folded yet, as the claim sees them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_fairqueue import conf
from django_fairqueue.db import pg
from django_fairqueue.queues import (
    row_name,
    split_row_name,
)

queries = pg.StatementFile("django_fairqueue.db", "statements/channels.sql")
_run = queries.run


@dataclass(frozen=True, slots=True)
class ChannelCounters:
    id: int
    name: str
    ready: int
    scheduled: int
    running: int
    failed: int
    succeeded: int


@dataclass(frozen=True, slots=True)
class GroupState:
    """A channel group's limits and scheduler state (:func:`select_group_state`)."""

    id: int
    name: str
    weight: int
    max_concurrency: int | None
    release_interval: timedelta
    #: sums over the group's channels, with their counter changes not folded yet (as each
    #: channel's figures are shown)
    ready: int
    running: int
    #: channels claimable by those counters (ready messages, not paused, under their cap)
    claimable: int
    channels: int
    next_turn_at: datetime
    vtime: float
    last_claimed_at: datetime | None


def select_group_state(
    ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[GroupState]:
    """The channel groups of ``ids`` (None: all), by name, with their scheduler state."""
    rows = _run("select_group_state", {"ids": None if ids is None else list(ids)}, using)
    return [GroupState(*row) for row in rows]


def creates_channels_apart(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether new channels must be created in a transaction of their own: inside any
    transaction, except one a Django test case opened (a test's rows roll back with it, and
    nothing else runs concurrently on its connection to deadlock with)."""
    if wrapper.get_autocommit() and not wrapper.in_atomic_block:
        return False
    blocks = wrapper.atomic_blocks
    return not (blocks and getattr(blocks[0], "_from_testcase", False))


#: Channel groups known to exist, per database alias: name -> when that was last seen (a
#: monotonic clock). A group seen less than GROUP_CACHE_SECONDS ago is not created again.
_known_groups: dict[tuple[str, str], float] = {}
GROUP_CACHE_SECONDS = 60.0


def ensure_groups(names: Sequence[str], *, using: str | None = None, verify: bool = False) -> None:
    """Create the channel groups of ``names`` that do not exist (a group takes in the existing
    channels its name declares, and every channel created later with a name
    ``"<group>/..."``). Committed at once, on a connection of its own inside a transaction,
    as new channels are: a channel created apart must see its group. Remembered for a minute
    per process, so an enqueue to a grouped channel pays this round trip about once a minute
    per group; ``verify`` makes sure of each group whatever this process remembers (before a
    channel of it is created: another process may have deleted the group meanwhile)."""
    alias = using or conf.get().DATABASE
    now = time.monotonic()
    wanted = sorted(
        n
        for n in set(names)
        if verify or now - _known_groups.get((alias, n), -1e18) > GROUP_CACHE_SECONDS
    )
    if not wanted:
        return
    wrapper = connections[alias]
    if creates_channels_apart(wrapper):
        with (
            pg.own_connection(using) as side,
            pg.kept_cursor(side.alias, wrapper=side) as cur,
        ):
            cur.execute(queries()["ensure_groups"], {"names": wanted}, prepare=False)
    else:
        _run("ensure_groups", {"names": wanted}, using)
        if wrapper.in_atomic_block:
            return  # a test case's transaction: rolled back, so not remembered
    for n in wanted:
        _known_groups[(alias, n)] = now


def forget_groups() -> None:
    """Forget which channel groups exist (after one was deleted in this process)."""
    _known_groups.clear()


#: How long creating channels apart waits for a name another transaction is creating (and
#: holds until it commits) before leaving the creation to the caller's own transaction, where
#: PostgreSQL's deadlock detector sees any cycle. Without a bound, a wait on a transaction that
#: itself waits for the caller would hang both, unseen by the detector.
CREATE_CHANNELS_LOCK_TIMEOUT = "2s"


def create_channels(
    names: Sequence[str], *, defaults: conf.ChannelDefaults, using: str | None = None
) -> None:
    """Create the channels of ``names`` that do not exist, committed at once on a connection
    of its own (so no caller's transaction holds a new channel's name)."""
    params = {
        "names": sorted(set(names)),
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
        "lock_timeout": CREATE_CHANNELS_LOCK_TIMEOUT,
    }
    try:
        with (
            pg.own_connection(using) as side,
            pg.kept_cursor(side.alias, wrapper=side) as cur,
        ):
            cur.execute(queries()["create_channels"], params, prepare=False, binary=True)
    except DatabaseError as exc:
        if not pg.is_lock_timeout(exc):
            raise


def fairness_by_time(fairness: str | None) -> bool:
    """Whether the claim orders channels by worker time (``fairness``, else the setting)."""
    mode = fairness if fairness is not None else conf.get().FAIRNESS
    if mode not in conf.FAIRNESS_MODES:
        raise ValueError(f"fairness must be one of {conf.FAIRNESS_MODES}, got {mode!r}")
    return mode == "time"


def fold_channel_deltas(
    limit: int = 10_000,
    *,
    wake_only: bool = False,
    fairness: str | None = None,
    using: str | None = None,
) -> int:
    """Fold up to ``limit`` of the oldest counter deltas (with ``wake_only``, of those that can
    make a channel claimable); returns how many."""
    params = {"limit": limit, "wake_only": wake_only, "by_time": fairness_by_time(fairness)}
    return int(_run("fold_channel_deltas", params, using)[0][0])


def fold_drained_markers(*, fairness: str | None = None, using: str | None = None) -> int:
    """Fold the markers of channels whose count ran out while enqueues may have been in
    flight, with their channels' quiet deltas (the maintenance loop's, after
    :func:`fold_channel_deltas`, in a transaction of its own); returns how many rows."""
    params = {"by_time": fairness_by_time(fairness)}
    return int(_run("fold_drained_markers", params, using)[0][0])


def select_channel_counters(
    ids: Sequence[int], *, using: str | None = None
) -> list[ChannelCounters]:
    if not ids:
        return []
    rows = _run("select_channel_counters", {"ids": list(ids)}, using)
    return [
        ChannelCounters(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]))
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class ChannelSummary:
    """A channel's configuration the listings show, and its exact counts."""

    id: int
    name: str
    weight: int
    paused: bool
    max_concurrency: int | None
    ready: int
    scheduled: int
    running: int
    failed: int
    succeeded: int


def select_all_channel_counts(*, using: str | None = None) -> list[ChannelSummary]:
    """Every channel with its counters plus pending deltas (one statement)."""
    return [ChannelSummary(*r) for r in _run("select_all_channel_counts", {}, using)]


def fold_deltas_of_channel(channel_id: int, *, using: str | None = None) -> int:
    """Fold one channel's pending counter deltas into its row now; returns how many.

    Waits for a claim holding the channel row (claims are short). Call it after changing a
    channel's limits: a cap added to a busy channel must count the completions not folded
    yet, or the channel looks full until the maintenance loop folds them; a rate limit
    removed must not leave its next turn in the future.
    """
    rows = _run("fold_deltas_of_channel", {"channel_id": channel_id}, using)
    return int(rows[0][0]) if rows else 0


def lift_group(group_id: int, *, using: str | None = None) -> None:
    """Lift one channel group's tag to its queue's virtual time now (fairness by time).

    Waits for a claim holding the group row (claims are short). Call it after raising a
    group's cap or weight or removing its rate limit: held back, the group kept the low tag it
    had, and would take every start until it caught up; the edit made it servable at once, so
    no fold lifts it. A rate limit removed or shortened also brings its next turn forward.
    """
    _run("lift_group", {"group_id": group_id}, using)


def level_channel_tags(*, using: str | None = None) -> int:
    """Set every channel's tag (fairness by time) to 0, as on a fresh install; returns how
    many moved. With :func:`level_group_tags` after it, in one transaction: ``manage.py
    fairqueue level``."""
    return int(_run("level_channel_tags", {}, using)[0][0])


def level_group_tags(*, using: str | None = None) -> int:
    """Set every channel group's tag to 0; returns how many moved (after the channels')."""
    return int(_run("level_group_tags", {}, using)[0][0])


def lock_channel_names(names: Sequence[str], *, using: str | None = None) -> None:
    """Hold channel names against enqueues until the current transaction ends: deleting a
    channel takes this first, so an enqueue in flight finishes (and its messages are deleted
    with the channel) and a later one creates the channel anew."""
    if names:
        _run("lock_channel_names", {"names": list(names)}, using)


def share_channel_name(name: str, *, using: str | None = None) -> None:
    """Take channel ``name``'s lock as an enqueue does, shared, until the transaction ends: a
    transaction that will enqueue to it takes it first when it locks other rows before its
    enqueue that deleting the channel locks too (the lock order's rank 1 comes first)."""
    _run("share_channel_name", {"name": name}, using)


def select_channel_ids(names: Sequence[str], *, using: str | None = None) -> dict[str, int]:
    if not names:
        return {}
    return {name: cid for cid, name in _run("select_channel_ids", {"names": list(names)}, using)}


def select_channel_ids_in_queues(
    names: Sequence[str], queues: Sequence[str] | None, *, using: str | None = None
) -> list[tuple[int, str, str]]:
    """``(id, queue, name)`` of the channel rows of ``names`` in ``queues`` (None: all)."""
    if not names:
        return []
    if queues is not None:  # the rows' names are known: index lookups
        rows = [row_name(q, n) for q in queues for n in names]
        return [
            (cid, *split_row_name(row))
            for row, cid in select_channel_ids(rows, using=using).items()
        ]
    params = {"names": list(names), "queues": None}
    return [(r[0], r[1], r[2]) for r in _run("select_channel_ids_in_queues", params, using)]


def select_channel_oldest_ready(
    ids: Sequence[int], *, using: str | None = None
) -> dict[int, datetime]:
    """{channel id: since when its longest-waiting ready message is ready}, for the channels
    of ``ids`` that have ready messages (one index probe per priority level in use)."""
    if not ids:
        return {}
    return dict(_run("select_channel_oldest_ready", {"ids": list(ids)}, using))


def select_backlogged_oldest_ready(*, using: str | None = None) -> dict[int, datetime]:
    """:func:`select_channel_oldest_ready` of every channel with ready messages (found by its
    counters in the same statement)."""
    return dict(_run("select_backlogged_oldest_ready", {}, using))


def select_channel_retrying(ids: Sequence[int], *, using: str | None = None) -> dict[int, int]:
    """{channel id: messages waiting out a retry's backoff}, for the channels of ``ids`` that
    have any. Reads the retries of these channels only (``fq_message_retrying_idx``); pass those
    with scheduled > 0."""
    if not ids:
        return {}
    return {cid: int(n) for cid, n in _run("select_channel_retrying", {"ids": list(ids)}, using)}


def ensure_channel(name: str, *, defaults: conf.ChannelDefaults, using: str | None = None) -> int:
    """The id of channel ``name``, created with ``defaults`` if it does not exist."""
    params = {
        "name": name,
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
    }
    return int(_run("ensure_channel", params, using)[0][0])


@dataclass(frozen=True, slots=True)
class ChannelWaitState:
    name: str
    paused: bool
    max_concurrency: int | None
    release_interval: timedelta
    next_turn_at: datetime
    ready: int
    running: int
    now: datetime
    ahead: int
    oldest_running_since: datetime | None
    claimed_recently: int
    #: its channel group (None: ungrouped) and the group's limits, as the claim checks them
    group: str | None = None
    group_max_concurrency: int | None = None
    group_running: int = 0
    group_release_interval: timedelta = timedelta(0)
    group_next_turn_at: datetime | None = None


def select_channel_wait_state(
    channel_id: int, *, using: str | None = None
) -> ChannelWaitState | None:
    params = {"channel_id": channel_id, "by_time": fairness_by_time(None)}
    rows = _run("select_channel_wait_state", params, using)
    if not rows:
        return None
    r = rows[0]
    return ChannelWaitState(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        int(r[5]),
        int(r[6]),
        r[7],
        int(r[8]),
        r[9],
        int(r[10]),
        r[11],
        r[12],
        int(r[13] or 0),
        r[14] if r[14] is not None else timedelta(0),
        r[15],
    )


def select_waking_backlog(beyond: int, *, using: str | None = None) -> bool:
    """Whether more than ``beyond`` waking counter deltas wait to be folded."""
    return bool(_run("select_waking_backlog", {"beyond": beyond}, using)[0][0])
