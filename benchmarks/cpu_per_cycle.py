r"""Server CPU per claim cycle: the figure to compare two versions on a busy machine.

Wall time on a shared 2-core machine moves by 2x from run to run; the CPU time the server
process spends for one connection moves far less. This loads 100,000 ready messages over 100
channels into the example project's database (it EMPTIES the queue tables there first), then
runs cycles of claim, complete and re-enqueue of what was claimed (with the maintenance fold
every 50 cycles) on one connection, and prints the server backend's CPU time per cycle (read
from /proc: server and client on one Linux machine), this process's CPU time inside the claim
call (turning the claimed rows into messages: a worker's claimer pays it per claim) and the
wall time, at claims of 1 and of 100::

    python3 dev.py manage migrate
    PYTHONPATH=. python3 dev.py manage shell \
        -c "from benchmarks import cpu_per_cycle; cpu_per_cycle.main()"

Run it alternately in two worktrees (before, after) a few times and compare the medians
(docs/performance.md, "Fairness by time: what it costs fairness by count").
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

from django.db import connection

from benchmarks.backlog import load_counted
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store, message_store

LEASE = timedelta(minutes=5)


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(cycles: tuple[tuple[int, int], ...] = ((1, 1500), (100, 300))) -> dict[int, dict]:
    bench_db.truncate_queue_tables()
    channels = [f"c{i:03d}" for i in range(100)]
    load_counted(channels, 100_000)
    with connection.cursor() as cur:
        cur.execute("SET synchronous_commit = off")
        cur.execute("SELECT pg_backend_pid()")
        (pid,) = cur.fetchone()
    done = 0
    claim_cpu = 0.0  # this thread's, inside claim_messages
    out: dict[int, dict] = {}
    for batch, n in cycles:

        def cycle(batch: int = batch) -> None:
            nonlocal done, claim_cpu
            started = time.thread_time()
            got = message_store.claim_messages(batch, lease=LEASE, worker_id="cpu-per-cycle")
            claim_cpu += time.thread_time() - started
            message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
            enqueue_many(EnqueueRequest(NOOP_TASK_NAME, (), channel=m.channel) for m in got)
            done += 1
            if done % 50 == 0:
                channel_store.fold_channel_deltas(10_000)

        for _ in range(30):  # plans cached, caches warm
            cycle()
        cpu, wall, claim_cpu = _cpu_seconds(pid), time.perf_counter(), 0.0
        for _ in range(n):
            cycle()
        out[batch] = {
            "server_cpu_ms_per_cycle": round(1000 * (_cpu_seconds(pid) - cpu) / n, 3),
            "client_claim_cpu_ms": round(1000 * claim_cpu / n, 3),
            "wall_ms_per_cycle": round(1000 * (time.perf_counter() - wall) / n, 3),
        }
    bench_db.truncate_queue_tables()
    print("cpu_per_cycle", json.dumps(out))
    return out
