"""What a worker of one queue pays for another queue's backlog: EXPLAIN (ANALYZE, BUFFERS).

Loads, into the example project's database (it EMPTIES the queue tables there first), one
channel with 1,000 ready messages in queue ``a``, then ``--channels`` channels (default 10,000)
with 10 ready messages each in queue ``b``. Then, each in a transaction that is rolled back
(so every sample starts from the same state), runs ``EXPLAIN (ANALYZE, BUFFERS)`` of one claim
and prints the median execution time and shared buffers touched (hit + read) of:

* ``a only, b paused``: a claim of queue ``a`` while ``b``'s channels are paused (the
  reference: the same tables, ``b`` holds nothing claimable);
* ``a only``: the same claim with ``b``'s 10,000 channels claimable (it must cost the same);
* ``b only``: a claim of queue ``b`` (its walk among 10,000 claimable channels);
* ``every queue``: a claim of every queue (finds the queues, then serves them in turn).

Buffers count the statements run inside the claim function (PostgreSQL charges nested
statements' buffer use to the calling node). Claims of 1 and of 100::

    python3 dev.py manage migrate
    python3 dev.py manage shell -c "from benchmarks import queues; queues.main()"

``ab()`` answers the other question, what a project with one queue pays for queues, before
and after in one session (a shared machine's load drifts more between two runs than the
difference measured). "before" is the claim as it was before queues: the claim function of
a migration's copy in git history (``before``, default ``0023_names_and_priorities_hold``),
installed under another name, walking the indexes as they were (without the leading
``queue``); "after" is the live function with the indexes as migrated, called as the
default worker calls it (every queue, ``p_queues`` NULL) and as ``runfairworker --queues
default`` calls it; "first queues" is the first claim with queues (``first``, default
``0024_queues``: it found the queues with a statement of their own before the group probe),
every queue (run it from a git checkout: both are read with ``git show``). Rounds
alternate the versions (the indexes are rebuilt for each: cheap at this size) and read the
server backend's CPU time from ``/proc``. Cells, each call as the worker makes it (a wait of
50 ms for held channels, housekeeping on), in a transaction rolled back so every call starts
from the same rows:

* ``idle poll``: empty tables (what an idle worker pays per poll);
* ``claim of 1`` and ``claim of 100``: 100 channels of the default queue, 1,000 ready
  messages each.

It EMPTIES the queue tables first and leaves the live function and indexes installed::

    python3 dev.py manage shell -c "from benchmarks import queues; queues.ab()"
"""

from __future__ import annotations

import importlib
import json
import statistics
from typing import Any

from django.db import connection, transaction

from benchmarks.backlog import load_counted
from benchmarks.enqueue_ab import function_ddl, migration_sql
from django_fairqueue import conf
from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.contrib.bench.harness import backend_cpu
from django_fairqueue.db import functions
from django_fairqueue.queues import row_name

CLAIM = (
    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM fairqueue_claim_v1("
    "%s, interval '5 minutes', 'bench-queues', NULL, NULL, NULL, true, 0, false, %s::text[])"
)
SAMPLES = 15


def _load(channels: list[str], per_channel: int) -> None:
    load_counted(channels, len(channels) * per_channel)


def _sample(limit: int, queues: list[str] | None) -> dict[str, Any]:
    # The samples roll back, but leave dead row versions and index entries behind: vacuum
    # first, so no case pays for the ones measured before it.
    with connection.cursor() as cur:
        cur.execute("VACUUM fairqueue_message, fairqueue_channel, fairqueue_channel_group")
    times, buffers = [], []
    for i in range(SAMPLES + 3):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(CLAIM, [limit, queues])
            (plan,) = cur.fetchone()[0]
            transaction.set_rollback(True)
        if i < 3:  # plans cached, caches warm
            continue
        top = plan["Plan"]
        times.append(plan["Execution Time"])
        buffers.append(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))
    return {
        "execution_ms_median": round(statistics.median(times), 3),
        "shared_buffers_median": statistics.median(buffers),
    }


def main(other_channels: int = 10_000) -> dict[str, Any]:
    bench_db.truncate_queue_tables()
    _load([row_name("a", "only")], 1_000)
    _load([row_name("b", f"t{i:05d}") for i in range(other_channels)], 10)
    out: dict[str, Any] = {}
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET paused = true WHERE queue = 'b'")
    for limit in (1, 100):
        out[f"a only, b paused, claim of {limit}"] = _sample(limit, ["a"])
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET paused = false WHERE queue = 'b'")
    bench_db.analyze_queue_tables()
    for limit in (1, 100):
        out[f"a only, claim of {limit}"] = _sample(limit, ["a"])
        out[f"b only, claim of {limit}"] = _sample(limit, ["b"])
        out[f"every queue, claim of {limit}"] = _sample(limit, None)
    bench_db.truncate_queue_tables()
    print("queues", json.dumps({"b_channels": other_channels, **out}, indent=2))
    return out


BEFORE_FUNCTION = "fairqueue_claim_v1_ab_before"
FIRST_FUNCTION = "fairqueue_claim_v1_ab_first"
AB_CLAIM = (
    "SELECT count(*) FROM {function}("
    "%s, interval '5 minutes', 'bench-queues', NULL, NULL, NULL, true, 50, false{queues})"
)
#: version: (claim statement, leading index column)
AB_VERSIONS = {
    "before": (AB_CLAIM.format(function=BEFORE_FUNCTION, queues=""), ""),
    "after, every queue": (
        AB_CLAIM.format(function="fairqueue_claim_v1", queues=", NULL::text[]"),
        "queue, ",
    ),
    "after, --queues default": (
        AB_CLAIM.format(function="fairqueue_claim_v1", queues=", ARRAY['default']"),
        "queue, ",
    ),
    # the first version with queues (``first``), every queue: what the change replaced
    "first queues, every queue": (
        AB_CLAIM.format(function=FIRST_FUNCTION, queues=", NULL::text[]"),
        "queue, ",
    ),
}
#: cell: (claim limit, channels, ready messages per channel)
AB_CELLS = {
    "idle poll": (1, 0, 0),
    "claim of 1": (1, 100, 1_000),
    "claim of 100": (100, 100, 1_000),
}


def _claim_indexes(lead: str) -> str:
    """The claim's four partial indexes, leading with ``lead`` (``"queue, "`` or nothing)."""
    queues_migration = importlib.import_module("django_fairqueue.migrations.0024_queues")
    return str(queues_migration._indexes(lead))


def _claim_ddl(migration: str, name: str) -> str:
    """``fairqueue_claim_v1`` as migration ``migration`` installed it, renamed ``name``."""
    return function_ddl(migration_sql(migration), "fairqueue_claim_v1").replace(
        "FUNCTION fairqueue_claim_v1(", f"FUNCTION {name}(", 1
    )


def ab(
    before: str = "0023_names_and_priorities_hold",
    rounds: int = 10,
    calls: int = 3_000,
    first: str = "0024_queues",
    cells: tuple[str, ...] = tuple(AB_CELLS),
) -> dict[str, Any]:
    """Server CPU per claim, before queues and after, alternating in one session (see the
    module docstring). Prints a line per cell and the figures as json. ``cells``: some of
    ``AB_CELLS`` only."""
    live_ddl = function_ddl(functions.sql("claim"), "fairqueue_claim_v1")
    cpu = backend_cpu(conf.get().DATABASE)
    if cpu is None:
        raise RuntimeError("the server backend's CPU time is not readable here")
    out: dict[str, Any] = {
        "before": before,
        "first": first,
        "rounds": rounds,
        "calls": calls,
        "cells": {},
    }
    try:
        with connection.cursor() as cur:
            cur.execute(_claim_ddl(before, BEFORE_FUNCTION))
            cur.execute(_claim_ddl(first, FIRST_FUNCTION))
            cur.execute(live_ddl)
        for cell in cells:
            limit, channels, per_channel = AB_CELLS[cell]
            bench_db.truncate_queue_tables()
            if channels:
                _load([f"ab{i:03d}" for i in range(channels)], per_channel)
            n = max(calls // max(1, limit // 10), 60)
            per_call: dict[str, list[float]] = {v: [] for v in AB_VERSIONS}
            order = list(AB_VERSIONS)
            for r in range(rounds):
                for version in order[r % len(order) :] + order[: r % len(order)]:
                    statement, lead = AB_VERSIONS[version]
                    with connection.cursor() as cur:
                        cur.execute(_claim_indexes(lead))
                        cur.execute("VACUUM fairqueue_message, fairqueue_channel")
                    for i in range(n + 20):
                        if i == 20:  # plans cached, caches warm
                            began = cpu()
                        with transaction.atomic(), connection.cursor() as cur:
                            cur.execute(statement, [limit])
                            if channels and cur.fetchone()[0] != limit:
                                raise RuntimeError(f"{version}: a claim of {limit} fell short")
                            transaction.set_rollback(True)
                    per_call[version].append(1e6 * (cpu() - began) / n)
            medians = {v: statistics.median(xs) for v, xs in per_call.items()}
            base = medians["before"]
            out["cells"][cell] = {
                "calls_per_round": n,
                "server_cpu_us_median": {v: round(m, 1) for v, m in medians.items()},
                "over_before": {v: round(m / base, 3) for v, m in medians.items()},
                "server_cpu_us_rounds": {v: [round(x) for x in xs] for v, xs in per_call.items()},
            }
            print(
                f"{cell:>12}: server CPU per claim "
                + ", ".join(f"{v} {m:.0f} µs ({m / base:.2f}x)" for v, m in medians.items())
            )
    finally:
        with connection.cursor() as cur:
            cur.execute(_claim_indexes("queue, "))
            cur.execute(f"DROP FUNCTION IF EXISTS {BEFORE_FUNCTION}")
            cur.execute(f"DROP FUNCTION IF EXISTS {FIRST_FUNCTION}")
            cur.execute(live_ddl)
        bench_db.truncate_queue_tables()
    print("queues_ab", json.dumps(out))
    return out


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run it from the Django shell (see the module docstring)")
