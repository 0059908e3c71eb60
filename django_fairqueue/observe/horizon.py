"""Who holds the xmin horizon back: the long transaction that slows every claim.

VACUUM may remove a dead row version only once no snapshot can still see it. One open
transaction holding a snapshot (a report in REPEATABLE READ, a migration, a forgotten ``psql``
session left ``idle in transaction``), a prepared transaction nobody committed, or a
replication slot whose consumer went away keeps every version written since it began: the
queue's hot tables and their indexes fill with dead versions that each claim walks past, and
claims slow down the longer it stays open.

:func:`holders` names them (pid, age, the start of the query) once they pass
``FAIRQUEUE['HORIZON_WARN_AFTER']`` seconds; ``fairqueue status``, the admin's dashboard and the
``fairqueue_xmin_horizon_seconds`` gauge show them (docs/reliability.md says what to do).
"""

from __future__ import annotations

from datetime import timedelta

from django_fairqueue import conf
from django_fairqueue.cli.terminal import printable
from django_fairqueue.db import pg
from django_fairqueue.db.pg import XminHolder
from django_fairqueue.observe.overview import format_age

#: Longest start of a holder's query shown on one line (the JSON keeps the 200 read).
QUERY_SHOWN = 80

#: How many transactions back a session holds the horizon before it is named when its age is
#: hidden: without pg_read_all_stats a role sees another role's sessions with their snapshot's
#: xmin but not when their transaction began. A queue at work runs hundreds of transactions a
#: second, so this is a minute or less of its traffic; a short query of another role passes
#: long before it gets there.
HIDDEN_MIN_XID_AGE = 10_000


def holders(*, limit: int = 5, min_age: float | None = None) -> list[XminHolder]:
    """The holders of the queue database's xmin horizon older than ``min_age`` seconds
    (default ``HORIZON_WARN_AFTER``), oldest snapshot first, at most ``limit``."""
    cfg = conf.get()
    age = cfg.HORIZON_WARN_AFTER if min_age is None else min_age
    return pg.select_xmin_holders(
        timedelta(seconds=age), min_xid_age=HIDDEN_MIN_XID_AGE, limit=limit, using=cfg.DATABASE
    )


def oldest_age() -> float:
    """Seconds since the oldest transaction (or prepared transaction) holding the horizon
    began, whatever its age; 0 when none holds it (slots have no start time: see
    :func:`holders`)."""
    ages = [h.age_seconds for h in holders(limit=20, min_age=0) if h.age_seconds is not None]
    return max(ages, default=0.0)


def describe(holder: XminHolder) -> str:
    """One line naming a holder for an operator: what it is, how long, what it runs."""
    back = f"{holder.xid_age:,} transactions back" if holder.xid_age is not None else ""
    if holder.kind == "slot":
        who = f"replication slot {printable(holder.name)!r} ({holder.state})"
        return f"{who}, holding the horizon {back}: drop it if nothing consumes it"
    age = format_age(holder.age_seconds)
    if holder.kind == "prepared":
        return (
            f"prepared transaction {printable(holder.name)!r} open for {age}, {back}: "
            "COMMIT PREPARED or ROLLBACK PREPARED it"
        )
    who = f"pid {holder.pid} ({printable(holder.name) or 'no name'}"
    if holder.age_seconds is None:  # another role's, seen without pg_read_all_stats
        return (
            f"{who}) in a transaction holding the horizon {back}; its age, state and query "
            "are not visible to this role (GRANT pg_read_all_stats TO it)"
        )
    query = printable(" ".join((holder.query or "").split()))
    if len(query) > QUERY_SHOWN:
        query = query[: QUERY_SHOWN - 3] + "..."
    shown = f": {query}" if query else " (its query is not visible to this role)"
    return f"{who}, {holder.state or 'unknown'}) in a transaction for {age}, {back}{shown}"


def as_dict(holder: XminHolder) -> dict[str, object]:
    """A holder for JSON (``fairqueue status --json``, the dashboard's data)."""
    return {
        "kind": holder.kind,
        "pid": holder.pid,
        "name": holder.name,
        "age_seconds": holder.age_seconds,
        "xid_age": holder.xid_age,
        "state": holder.state,
        "query": holder.query,
        "text": describe(holder),
    }
