r"""Server CPU per ``enqueue()`` under two versions of the enqueue function, in one session.

Two runs on a shared 2-core machine differ by more than most changes to a statement. This
measures both versions in the same session, on the same rows, alternating rounds: it installs
``fairqueue_enqueue_one_v1`` as a migration installed it (``before``, from git history) or from
the live ``db/functions/enqueue.sql`` (``after``) and times rounds of ``enqueue()`` calls,
reading the server backend's CPU time from ``/proc`` (server and client on one Linux
machine). It EMPTIES the queue tables of the example project's database first, and puts the
live function back at the end::

    python3 dev.py manage migrate
    PYTHONPATH=. python3 dev.py manage shell \
        -c "from benchmarks import enqueue_ab; enqueue_ab.main()"

Cells:

- ``uncounted``: a channel with a 20,000 backlog that no claim has counted yet (no worker
  ran since: the side-by-side enqueue scenario's case);
- ``counted``: the same backlog counted on the channel row (folded, as every claim does),
  none of it claimed;
- ``half-drained``: a channel whose workers took the first half of that backlog, as under
  load: the claimed messages' entries stay in the ready index, dead, until vacuum runs.

``main(before="0018_faster_enqueue")`` names the migration whose version is "before", and
``main(before="commit:8d2b8b5")`` the version of a commit since the migrations stopped
carrying copies (both read with ``git show``: run it from a git checkout).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.db import connection

from django_fairqueue import conf
from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.contrib.bench.harness import backend_cpu
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store, functions, message_store

#: Until this commit each migration that changed a function carried a whole copy of the function
#: file, ``django_fairqueue/migrations/sql/<migration>.sql``: the "before" versions named here.
COPIES_AT = "2a3c146"

FUNCTION = "fairqueue_enqueue_one_v1"
CHANNEL = "enqueue-ab"
BACKLOG = 20_000


def migration_sql(migration: str) -> str:
    """The function file as migration ``migration`` installed it, from the git history; for
    ``commit:REV``, the enqueue functions' file at that commit."""
    if migration.startswith("commit:"):
        path = f"{migration.removeprefix('commit:')}:django_fairqueue/db/functions/enqueue.sql"
    else:
        path = f"{COPIES_AT}:django_fairqueue/migrations/sql/{migration}.sql"
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        ["git", "show", path], cwd=root, check=True, capture_output=True, text=True
    ).stdout


def function_ddl(sql: str, name: str = FUNCTION) -> str:
    """The ``CREATE OR REPLACE FUNCTION name(...)`` statement of a functions file."""
    found = re.search(
        rf"^CREATE OR REPLACE FUNCTION {name}\(.*?^\$\$;$", sql, flags=re.DOTALL | re.MULTILINE
    )
    if found is None:
        raise ValueError(f"no function {name} in that SQL")
    return found.group(0)


#: the cells, in running order
CELLS = ("uncounted", "counted", "half-drained")


def _load(cell: str) -> None:
    bench_db.truncate_queue_tables()
    enqueue_many(EnqueueRequest(NOOP_TASK_NAME, (i,), channel=CHANNEL) for i in range(BACKLOG))
    if cell == "uncounted":
        return
    while channel_store.fold_channel_deltas(10_000) > 0:
        pass
    if cell == "half-drained":
        taken = 0
        while taken < BACKLOG // 2:
            got = message_store.claim_messages(
                100, lease=timedelta(hours=1), worker_id="enqueue-ab"
            )
            if not got:
                raise RuntimeError("the claim that drains half the backlog stopped")
            taken += len(got)


def main(
    before: str = "0018_faster_enqueue", rounds: int = 8, calls: int = 2_000
) -> dict[str, Any]:
    versions = {
        "before": function_ddl(migration_sql(before)),
        "after": function_ddl(functions.sql("enqueue")),
    }
    using = conf.get().DATABASE
    out: dict[str, Any] = {"before": before, "rounds": rounds, "calls": calls, "cells": {}}
    try:
        for cell in CELLS:
            _load(cell)
            cpu = backend_cpu(using)
            if cpu is None:
                raise RuntimeError("the server backend's CPU time is not readable here")
            per_call: dict[str, list[float]] = {v: [] for v in versions}
            for r in range(rounds):
                for version in versions if r % 2 == 0 else reversed(versions):
                    with connection.cursor() as cur:
                        cur.execute(versions[version])
                    for i in range(20):  # the plan of the new definition cached
                        enqueue(NOOP_TASK_NAME, i, channel=CHANNEL)
                    began = cpu()
                    for i in range(calls):
                        enqueue(NOOP_TASK_NAME, i, channel=CHANNEL)
                    per_call[version].append(1e6 * (cpu() - began) / calls)
            medians = {v: statistics.median(xs) for v, xs in per_call.items()}
            out["cells"][cell] = {
                "server_cpu_us_median": {v: round(m, 1) for v, m in medians.items()},
                "after_over_before": round(medians["after"] / medians["before"], 3),
                "server_cpu_us_rounds": {v: [round(x) for x in xs] for v, xs in per_call.items()},
            }
            print(
                f"{cell:>12}: server CPU per enqueue() {medians['before']:.0f} µs before, "
                f"{medians['after']:.0f} µs after ({medians['after'] / medians['before']:.2f}x)"
            )
    finally:
        with connection.cursor() as cur:
            cur.execute(versions["after"])
        bench_db.truncate_queue_tables()
    print("enqueue_ab", json.dumps(out))
    return out
