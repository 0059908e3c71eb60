r"""Server CPU per idle poll, made as a worker makes it.

A worker that finds nothing claims again every poll interval (and at every notification), with
its commit relaxed (``ASYNC_COMMIT``) but for the at-most-once tasks it lists; a fleet of idle
workers pays this figure many times a second. This empties the queue tables of the example
project's database, then runs ``polls`` claims of 100 that find nothing, as the worker's claim
calls them, and prints the server backend's CPU time per poll (read from /proc: server and
client on one Linux machine)::

    python3 dev.py manage migrate
    PYTHONPATH=. python3 dev.py manage shell -c "from benchmarks import idle_poll; idle_poll.main()"

A poll costs tens of microseconds and the CPU is read in ticks of 10 ms: 10,000 polls make a
tick a microsecond per poll. Run it alternately in two worktrees (before, after) a few times
and compare the medians, as ``benchmarks/cpu_per_cycle.py``.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.contrib.bench.harness import backend_cpu
from django_fairqueue.db import message_store

#: as a worker passes it: the at-most-once tasks, whose claim keeps its commit durable
DURABLE_TASKS = ["idle-poll.at-most-once"]


def main(polls: int = 10_000) -> dict[str, float]:
    bench_db.truncate_queue_tables()
    cpu = backend_cpu("default")
    if cpu is None:
        raise SystemExit("idle_poll: the server's /proc is not readable from here")

    def poll() -> None:
        got = message_store.claim_messages(
            100,
            lease=timedelta(minutes=5),
            worker_id="idle-poll",
            async_commit=True,
            durable_tasks=DURABLE_TASKS,
        )
        if got:
            raise SystemExit("idle_poll: the queue is not empty")

    for _ in range(200):  # plans cached
        poll()
    started, wall = cpu(), time.perf_counter()
    for _ in range(polls):
        poll()
    out = {
        "server_cpu_us_per_poll": round(1e6 * (cpu() - started) / polls, 1),
        "wall_us_per_poll": round(1e6 * (time.perf_counter() - wall) / polls, 1),
    }
    print("idle_poll", json.dumps(out))
    return out
