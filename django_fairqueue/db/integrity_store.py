"""The integrity recount: counters and unique-key holds checked against the rows they
count (verify: read-only, one snapshot), and recounted from them under their row locks
(repair). ``django_fairqueue.integrity`` drives these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.db import transaction

from django_fairqueue import conf
from django_fairqueue.db import pg

queries = pg.StatementFile("django_fairqueue.db", "statements/integrity.sql")
_run = queries.run


@dataclass(frozen=True, slots=True)
class CounterDrift:
    """A channel counter that disagrees with the rows it counts (``kind`` "group": a channel
    group's sum that disagrees with its channels' counters; ``channel_id`` and ``channel`` are
    then the group's)."""

    channel_id: int
    channel: str
    counter: str
    recorded: int
    actual: int
    kind: str = "channel"


def verify_channel_counters(
    ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[CounterDrift]:
    """Counters (of the channels of ``ids``, or of all) that disagree with their messages and
    work batches. Read-only and lock-free: one snapshot sees every writer's rows and counters
    together (a scan of the queue's waiting and running rows)."""
    rows = _run("verify_channel_counters", {"ids": list(ids) if ids is not None else None}, using)
    return [CounterDrift(*r) for r in rows]


def repair_channel_counters(ids: Sequence[int], *, using: str | None = None) -> list[CounterDrift]:
    """Recount the channels of ``ids`` from their rows, each under its row lock (waits for a
    claim holding it). Returns what was wrong at that moment."""
    if not ids:
        return []
    return [CounterDrift(*r) for r in _run("repair_channel_counters", {"ids": list(ids)}, using)]


def verify_group_counters(
    ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[CounterDrift]:
    """Channel groups (of ``ids``, or all) whose sums (ready, running, claimable channels)
    disagree with their channels' counters. Read-only and lock-free, one snapshot."""
    rows = _run("verify_group_counters", {"ids": list(ids) if ids is not None else None}, using)
    return [CounterDrift(r[0], r[1], r[2], r[3], r[4], kind="group") for r in rows]


#: The sums of a group, as verify_group_counters names them, and set_group_sums' arrays.
_GROUP_SUMS = {"ready": "ready", "running": "running", "claimable channels": "claimable"}


def repair_group_counters(ids: Sequence[int], *, using: str | None = None) -> list[CounterDrift]:
    """Recount the sums of the groups of ``ids`` from their channels, under the groups' row
    locks (the recount is a statement after the lock, so it sees every channel change
    committed before it). Returns what was wrong at that moment."""
    if not ids:
        return []
    with transaction.atomic(using=using or conf.get().DATABASE):
        lock_groups(ids, using=using)
        drift = verify_group_counters(sorted(ids), using=using)
        fixed: dict[int, dict[str, int]] = {}
        for d in drift:
            fixed.setdefault(d.channel_id, {})[_GROUP_SUMS[d.counter]] = d.actual
        if fixed:
            set_group_sums(fixed, using=using)
    return drift


def set_group_sums(sums: Mapping[int, Mapping[str, int]], *, using: str | None = None) -> None:
    """Write recounted sums, {group id: {"ready"/"running"/"claimable": value}} (a sum left
    out stays), of groups this transaction has locked (:func:`lock_groups`)."""
    _run(
        "set_group_sums",
        {
            "ids": list(sums),
            **{a: [s.get(a) for s in sums.values()] for a in _GROUP_SUMS.values()},
        },
        using,
    )


def lock_groups(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Lock the channel groups of ``ids`` until the transaction ends (in id order, waiting);
    returns the ids of those that exist."""
    return [r[0] for r in _run("lock_groups", {"ids": sorted(ids)}, using)]


def verify_unique_holds(*, using: str | None = None) -> list[CounterDrift]:
    """Channels whose unique jobs of scope ``active`` that hold their key (waiting or running)
    are not all named by their key's hold row (``recorded``: how many are, ``actual``: how many
    there are). Without its row, a running one would not keep its key. Read-only, lock-free."""
    return [CounterDrift(*r) for r in _run("verify_unique_holds", {}, using)]


def repair_unique_holds(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Give the unnamed holders of the channels ``ids`` their keys' hold rows (unless another
    live holder is named: two messages hold the key, left to the operator). Returns the ids of
    the messages now named."""
    if not ids:
        return []
    return [int(r[0]) for r in _run("repair_unique_holds", {"ids": list(ids)}, using)]


def verify_orphans(*, using: str | None = None) -> dict[str, int]:
    """{table: rows whose channel no longer exists}."""
    return {table: int(n) for table, n in _run("verify_orphans", {}, using)}


def repair_orphans(*, using: str | None = None) -> dict[str, int]:
    """Delete the rows :func:`verify_orphans` counts; returns {table: rows deleted}."""
    return {table: int(n) for table, n in _run("repair_orphans", {}, using)}
