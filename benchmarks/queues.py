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
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from django.db import connection, transaction

from benchmarks.backlog import load_counted
from django_fairqueue.contrib.bench import db as bench_db
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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run it from the Django shell (see the module docstring)")
