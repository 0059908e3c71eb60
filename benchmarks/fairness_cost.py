r"""What a claim by time costs against a claim by count, interleaved call by call.

Two backlogs of 100 channels x 1,000 no-op messages in one database, one in queue
``by-count`` and one in queue ``by-time``; a claim by count of the first and a claim by time of
the second take turns (which goes first alternates), each followed by the completion of what
it took and as many new messages to the same channels (steady traffic). The server backend's
CPU per claim is read from /proc around each claim and summed per mode: whatever else the
machine does in the meantime falls on both. Prints the CPU per claim of each mode, their ratio
and the ratio per block of claims (how much it moves), at claims of 1 and of 100. It EMPTIES the
queue tables of the example project's database first::

    python3 dev.py manage migrate
    PYTHONPATH=. python3 dev.py manage shell \
        -c "from benchmarks import fairness_cost; fairness_cost.main()"

docs/performance.md, "Fairness by time: what it costs fairness by count".
"""

from __future__ import annotations

import json
import statistics
from datetime import timedelta

from django.db import connection

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.contrib.bench.harness import backend_cpu
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store, message_store

LEASE = timedelta(minutes=5)
MODES = ("count", "time")


def _enqueue(channels: list[str], queue: str) -> None:
    enqueue_many(EnqueueRequest(NOOP_TASK_NAME, (), channel=c, queue=queue) for c in channels)


def main(
    cycles: tuple[tuple[int, int], ...] = ((1, 3000), (100, 600)),
    blocks: int = 6,
    backlog: int = 1000,
) -> dict[int, dict]:
    """``cycles``: (claim size, claims per mode); ``blocks``: how many parts the per-block
    ratios split those claims into; ``backlog``: messages per channel. A claim larger than
    the backlog (``cycles=((200, 600),), backlog=1``, as docs/performance.md ran it) comes
    back short, every time: what such a claim costs, the walk that finds the channels
    exhausted included."""
    bench_db.truncate_queue_tables()
    for by in MODES:
        channels = [f"{by}-{i:03d}" for i in range(100)]
        for start in range(0, backlog, 100):
            _enqueue(channels * min(100, backlog - start), f"by-{by}")
    while channel_store.fold_channel_deltas(10_000) > 0:
        pass
    bench_db.analyze_queue_tables()
    with connection.cursor() as cur:
        cur.execute("SET synchronous_commit = off")
    cpu = backend_cpu("default")
    if cpu is None:
        raise SystemExit("fairness_cost: the server's /proc is not readable from here")
    out: dict[int, dict] = {}
    for batch, n in cycles:
        spent = {by: [0.0] * blocks for by in MODES}
        for i in range(-30, n):  # 30 rounds untimed: plans cached, caches warm
            for by in MODES if i % 2 else reversed(MODES):
                started = cpu()
                got = message_store.claim_messages(
                    batch, lease=LEASE, worker_id="fairness-cost", fairness=by, queues=[f"by-{by}"]
                )
                took = cpu() - started
                if len(got) != min(batch, 100 * backlog):
                    raise SystemExit(f"fairness_cost: a claim of {batch} by {by} got {len(got)}")
                if i >= 0:
                    spent[by][i * blocks // n] += took
                message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
                _enqueue([m.channel for m in got], f"by-{by}")
            if i % 50 == 49:  # the maintenance loop's fold
                channel_store.fold_channel_deltas(10_000)
        total = {by: sum(spent[by]) for by in MODES}
        # (None where by count used no clock tick: the CPU is read in ticks of 10 ms)
        blocked = [t / c if c else None for t, c in zip(spent["time"], spent["count"], strict=True)]
        known = [r for r in blocked if r is not None]
        out[batch] = {
            "claims": n,
            **{f"by_{by}_cpu_us": round(1e6 * total[by] / n) for by in MODES},
            "time_over_count": round(total["time"] / total["count"], 3) if total["count"] else None,
            "per_block": [None if r is None else round(r, 2) for r in blocked],
            "per_block_median": round(statistics.median(known), 3) if known else None,
        }
    bench_db.truncate_queue_tables()
    print("fairness_cost", json.dumps(out))
    return out
