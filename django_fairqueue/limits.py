"""Bounds: of names and channel limits, and of the integers passed to PostgreSQL.

Shared by the models, the settings, the API and the commands. No Django import, so that
settings validation (``conf``) and the task registry need not import the models.

A message id is a ``bigint`` (1 to 2**63 - 1) and a row count an ``integer`` (at most
2**31 - 1): a value past either would reach the server and come back as a raw ``DataError``
(bigint out of range). :func:`integer` and its kin refuse it first, with a ValueError that
names the argument, or, for a command's option, with a usage error.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from datetime import timedelta

#: Longest channel name accepted (characters). Names are identifiers, not documents.
CHANNEL_NAME_MAX_LENGTH = 200
#: Longest queue name accepted (characters); see django_fairqueue.queues.
QUEUE_NAME_MAX_LENGTH = 64
#: Longest channel group name accepted (characters); a group name has no '/'.
GROUP_NAME_MAX_LENGTH = 100
#: Upper bounds that catch typos (a weight of 1e9 is a mistake, not a policy).
MAX_WEIGHT = 1000
MAX_CONCURRENCY_LIMIT = 1_000_000
MAX_RELEASE_INTERVAL = timedelta(days=1)
#: Longest retry delay, for ``RETRY_BACKOFF_BASE`` and ``RETRY_BACKOFF_MAX`` (seconds). A retry
#: is written for now + the delay and read back into a Python datetime, which ends with year
#: 9999: a year is far longer than any retry policy and far inside what both can hold.
MAX_RETRY_DELAY = timedelta(days=365)
#: Longest retention of finished rows and usage: the pruners delete what is older than now
#: minus it, a date Python and PostgreSQL must still hold. A century keeps rows for ever in
#: practice.
MAX_RETENTION = timedelta(days=36_500)
TASK_NAME_MAX_LENGTH = 200
#: Longest unique key accepted (characters), as channel names.
UNIQUE_KEY_MAX_LENGTH = 200
#: Longest worker id accepted (characters): the registry's and a message's column.
WORKER_ID_MAX_LENGTH = 200
#: A message's priority range: django.tasks' own, so a task moves between backends unchanged.
MIN_PRIORITY = -100
MAX_PRIORITY = 100


def priority_error(priority: object) -> str | None:
    """Why ``priority`` is not a message priority, or None when it is one."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"priority must be an integer, got {priority!r}"
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        return f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}"
    return None


#: Shortest lease `runfairworker --lease` accepts (the setting only warns, fairqueue.W002): the
#: heartbeat renews leases every third of it, and a claimed message must reach its thread and
#: its first renewal well inside it (a lease that expires first loses every message it claims,
#: each at the cost of an attempt).
MIN_LEASE = 5.0
#: Longest lease (a day): a dead worker's messages wait at most that long to run again.
MAX_LEASE = 86_400.0
#: Longest poll interval, seconds between claims when no wake-up arrives (an hour).
MAX_POLL_INTERVAL = 3600.0
#: Largest message id (PostgreSQL ``bigint``).
MAX_ID = 2**63 - 1
#: Largest limit or count (PostgreSQL ``integer``).
MAX_LIMIT = 2**31 - 1


def seconds_text(value: timedelta) -> str:
    """A duration in a message: seconds, with days or hours when it has whole ones
    ("86400 seconds (1 day)"), so that a negative one does not read as "-1 day, 23:59:59"."""
    total = value.total_seconds()
    text = f"{number_text(total)} seconds"
    for unit, size in (("day", 86400), ("hour", 3600)):
        if total and total % size == 0:
            count = int(total // size)
            return f"{text} ({count} {unit}{'' if abs(count) == 1 else 's'})"
    return text


def number_text(value: float) -> str:
    """A number as written, without a float's ".0" or an exponent for whole ones."""
    return str(int(value)) if value.is_integer() else f"{value:g}"


def integer(value: object, name: str, *, minimum: int, maximum: int) -> int:
    """``value`` if it is an int (not a bool) within ``minimum..maximum``; else a ValueError
    (a TypeError for what is not an integer at all)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be {minimum} to {maximum}, got {value!r}")
    return value


def worker_id(value: object) -> str:
    """A worker id: a string that is not blank, of at most :data:`WORKER_ID_MAX_LENGTH`
    characters (a worker's, a work batch claimer's, an exactly-once batch's)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"worker_id must be a non-empty string, got {value!r}")
    if len(value) > WORKER_ID_MAX_LENGTH:
        raise ValueError(f"worker_id must be at most {WORKER_ID_MAX_LENGTH} characters")
    return value


def not_one_name(value: object, name: str, kind: str = "") -> None:
    """Refuse one string where a list of names is wanted (``name``: the parameter; ``kind``:
    of what, "channel"): a str is a sequence of strings too, and ``list("acme")`` would be the
    four channels a, c, m and e."""
    if isinstance(value, str):
        of = f"{kind} names" if kind else "names"
        raise TypeError(f"{name} must be a list of {of}, not a string")


def limit(value: object, name: str = "limit") -> int:
    """A row limit: 1 to :data:`MAX_LIMIT`."""
    return integer(value, name, minimum=1, maximum=MAX_LIMIT)


def message_ids(ids: Iterable[object]) -> list[int]:
    """Message ids, each 1 to :data:`MAX_ID`, in the order given (:func:`row_ids`)."""
    return row_ids(ids, "message")


def row_ids(ids: Iterable[object], what: str) -> list[int]:
    """Ids of ``what`` rows ("message", "batch", "schedule": ``bigint`` keys), each 1 to
    :data:`MAX_ID`, in the order given. A string, a lone int or None is a TypeError (a common
    slip: ``cancel(5)`` for ``cancel([5])``)."""
    if isinstance(ids, int | str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be a list of {what} ids")
    return [integer(i, f"a {what} id", minimum=1, maximum=MAX_ID) for i in ids]


def option(minimum: int, maximum: int, what: str = "an integer") -> Callable[[str], int]:
    """An argparse ``type`` accepting ``minimum..maximum``: anything else is a usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be {what} from {minimum} to {maximum}, got {text!r}"
            )
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


#: argparse types: a message id, a row limit, an id cursor (0 or an id).
message_id = option(1, MAX_ID, "a message id")
limit_option = option(1, MAX_LIMIT, "an integer")
after_id = option(0, MAX_ID, "an integer")


def lease(value: object, name: str = "lease", *, minimum: float = MIN_LEASE) -> timedelta:
    """A lease given in code: a ``timedelta`` from ``minimum`` (:data:`MIN_LEASE`, as
    ``runfairworker --lease`` takes it in seconds) to :data:`MAX_LEASE` seconds. Returns it."""
    if not isinstance(value, timedelta):
        raise TypeError(
            f"{name} must be a timedelta (e.g. timedelta(seconds=60)), got {type(value).__name__}"
        )
    if not minimum <= value.total_seconds() <= MAX_LEASE:
        raise ValueError(
            f"{name} must be {minimum:g} to {MAX_LEASE:g} seconds, got "
            f"{number_text(value.total_seconds())}"
        )
    return value


def seconds(value: object, name: str, *, minimum: float, maximum: float) -> float:
    """A duration given in code as a number of seconds (int or float, not bool), finite, from
    ``minimum`` to ``maximum``. Returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} is a number of seconds, got {type(value).__name__}")
    if not minimum <= value <= maximum:  # (NaN fails this too)
        raise ValueError(f"{name} must be {minimum:g} to {maximum:g} seconds, got {value!r}")
    return float(value)
