"""A randomized concurrency stress test of the scheduler's invariants.

Client processes (tests/stressclient.py) run a seeded random mix of every public operation for
``FAIRQUEUE_STRESS_SECONDS`` (default 30): enqueue and enqueue_many over random channel sets in
random orders, several enqueue() calls in one transaction, rollbacks, brand-new channels, bounded
channels (``ChannelFull`` is expected), limit edits through every ORM path (a full ``save()`` of
an instance loaded seconds earlier, ``save(update_fields=...)``, ``QuerySet.update()``,
``bulk_update``), pause and resume, cancel, retry and delete of dead letters, purge, and delete
of a channel. Two real workers (short leases) claim, settle, heartbeat and rescue meanwhile; one
is SIGKILLed and replaced mid-run. A sampler reads every channel's running work against its cap
every 50 ms. Then the clients stop, the workers drain the queue, and the test checks:

1. no deadlock: no client error or worker log line mentions one, and PostgreSQL's
   ``pg_stat_database.deadlocks`` of the test database did not grow;
2. nothing stuck: every committed message is terminal or gone, nothing is ready, scheduled or
   running; nothing exists or ran that was not committed (rolled back);
3. nothing ran twice unless a fault explains it (a raise, a killed worker, an expired lease);
4. no sample saw a channel running more than its cap (unless the cap was lowered after), nor
   a channel group running more messages than its cap;
5. every channel's counters (columns + pending deltas) equal the real counts, no queue row
   belongs to a channel that no longer exists, and every channel group's sums equal its
   channels';
6. no client operation failed other than in the ways the mix expects;
7. no unique key is held by two messages of a channel at once;
8. the worker serving only queue ``reports`` (``--queues reports``) ran nothing of another queue.

A third of the enqueued work goes to queue ``reports``, whose channels (the same names, capped
the same way) and group are rows of their own; the other workers serve every queue.

The mix also enqueues unique jobs (every scope and conflict policy, alone and in batches),
cancels by channel and task, and aborts waiting and running messages.

``FAIRQUEUE_STRESS_SEED`` replays a seed (the operation mix, not the timing);
``FAIRQUEUE_STRESS_CLIENTS`` sets the number of client processes (default 3);
``FAIRQUEUE_STRESS_SKIP`` leaves operation kinds out of the mix;
``FAIRQUEUE_STRESS_REPORT=path`` writes the figures as JSON. See docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from django_fairqueue.models import Channel, ChannelGroup
from django_fairqueue.queues import row_name
from tests import stresskit
from tests.faults.harness import Db, Fleet, wait_listening
from tests.stresstasks import LOG_TABLES
from tests.workerkit import ROOT, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.stress, pytest.mark.django_db(transaction=True)]

SECONDS = float(os.environ.get("FAIRQUEUE_STRESS_SECONDS", "30"))
CLIENTS = int(os.environ.get("FAIRQUEUE_STRESS_CLIENTS", "3"))
#: Operation kinds left out of the mix (comma-separated, e.g. "edit_stale_save,delete_channel"),
#: to tell which operation breaks an invariant.
SKIP = os.environ.get("FAIRQUEUE_STRESS_SKIP", "")
#: The workers' FAIRNESS setting: "time" (the default) or "count"; the invariants are the same.
FAIRNESS = os.environ.get("FAIRQUEUE_STRESS_FAIRNESS", "time")
WORKERS = 2
#: The workers drain what the clients left until nothing is left, or nothing more settled for
#: DRAIN_STALL seconds, or DRAIN_LIMIT seconds passed.
DRAIN_STALL = 10.0
DRAIN_LIMIT = max(60.0, SECONDS)
#: Short leases: a killed worker's messages come back within seconds.
OVERRIDES = {
    "TASK_MODULES": ["tests.fairtasks", "tests.stresstasks"],
    "LEASE_SECONDS": 4.0,
    "RESCUE_INTERVAL": 0.5,
    "POLL_INTERVAL": 0.5,
    "RETRY_BACKOFF_BASE": 0.1,
    "RETRY_BACKOFF_MAX": 0.5,
    "FAIRNESS": FAIRNESS,
}
WORKER_ARGS = ("--concurrency", "4", "--batch-size", "10", "--verbosity", "0")

#: The channels every client mixes: (name, max_concurrency, max_backlog, weight, interval ms).
CHANNELS = [
    ("t00", 1, None, 1, 0),
    ("t01", 2, None, 1, 0),
    ("t02", 3, None, 2, 0),
    ("t03", None, None, 1, 0),
    ("t04", None, None, 3, 0),
    ("t05", 2, None, 1, 20),
    ("t06", None, None, 1, 0),
    ("t07", 1, None, 1, 0),
    ("b0", 2, 25, 1, 0),
    ("b1", None, 25, 1, 0),
    ("b2", None, 25, 1, 0),
    ("b3", 1, 40, 1, 0),
    # channels of channel group "g" (GROUPS: its cap holds over all three)
    ("g/a", None, None, 1, 0),
    ("g/b", 1, None, 2, 0),
    ("g/c", None, None, 1, 0),
]
#: Channel groups created before the channels: (name, max_concurrency, weight).
GROUPS = [("g", 3, 2)]


def _seed() -> int:
    given = os.environ.get("FAIRQUEUE_STRESS_SEED")
    return int(given) if given else random.SystemRandom().randrange(1, 10**6)


def _expected_error(error: dict[str, str]) -> bool:
    """A client error the mix provokes on purpose: a stale instance saved after its channel
    was deleted and its name taken by a new channel (Django then inserts the old id and the
    name is not unique)."""
    return error["op"] == "edit_stale_save" and "fq_channel_name_uniq" in error["text"]


def _where(error: dict[str, str]) -> list[str]:
    """The last two frames of an error's traceback."""
    frames = [line.strip() for line in error["traceback"].splitlines() if "File " in line]
    return frames[-2:]


def test_stress(database_url: str, tmp_path: Path) -> None:
    seed = _seed()
    print(
        f"\nstress: seed {seed} (FAIRQUEUE_STRESS_SEED={seed} replays the operation mix), "
        f"fairness by {FAIRNESS} (FAIRQUEUE_STRESS_FAIRNESS)"
    )
    db = Db(database_url)
    db.conn.execute(LOG_TABLES)
    deadlocks_before = stresskit.deadlocks_of_database(db)
    for queue in ("default", "reports"):  # each queue's rows, limited alike
        for group, cap, weight in GROUPS:
            ChannelGroup.objects.create(
                name=row_name(queue, group), max_concurrency=cap, weight=weight
            )
        for name, cap, backlog, weight, interval in CHANNELS:
            Channel.objects.create(
                name=row_name(queue, name),
                max_concurrency=cap,
                max_backlog=backlog,
                weight=weight,
                release_interval=timedelta(milliseconds=interval),
            )

    fleet = Fleet(database_url, OVERRIDES, args=WORKER_ARGS)
    sampler = stresskit.Sampler(Db(database_url))
    clients: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    killed: set[int] = set()
    try:
        fleet.start(WORKERS - 1)
        reports_only = {w.pid for w in fleet.start(1, "--queues", "reports")}
        wait_listening(db, fleet)
        sampler.start()
        began = time.monotonic()
        env = {**os.environ, "DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1"}
        env.pop("FAIRQUEUE_TEST_OVERRIDES", None)
        names = ",".join(c[0] for c in CHANNELS)
        for n in range(CLIENTS):
            out = tmp_path / f"client-{n}.json"
            err = tmp_path / f"client-{n}.stderr"
            with err.open("wb") as stderr:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.stressclient",
                        "--seed",
                        str(seed),
                        "--client",
                        str(n),
                        "--seconds",
                        str(SECONDS),
                        "--channels",
                        names,
                        "--out",
                        str(out),
                        "--skip",
                        SKIP,
                    ],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            clients.append((proc, out, err))

        # Faults: SIGKILL a worker and start another, once in a short run (every minute in a
        # long one).
        kill_at = [SECONDS * 0.4] if SECONDS <= 90 else list(range(60, int(SECONDS), 60))
        rng = random.Random(seed)
        while any(p.poll() is None for p, _, _ in clients):
            if kill_at and time.monotonic() - began >= kill_at[0]:
                kill_at.pop(0)
                victim: WorkerProcess = rng.choice(fleet.workers)
                victim.signal(signal.SIGKILL)
                victim.wait(10)
                killed.add(victim.pid)
                fleet.workers.remove(victim)
                fleet.retired.append(victim)
                fleet.start(1)
            if time.monotonic() - began > SECONDS + 60:
                raise AssertionError("stress clients did not stop within a minute of the end")
            time.sleep(0.1)
        load_seconds = time.monotonic() - began

        # Drain: paused channels would keep their backlog forever.
        Channel.objects.filter(paused=True).update(paused=False)
        drain_seconds, left, drain_trace = stresskit.wait_unsettled(db, DRAIN_STALL, DRAIN_LIMIT)
        sampler.stop()
        crashed = [
            f"{w.worker_id} (pid {w.pid}) exited {w.proc.returncode}"
            for w in fleet.workers
            if w.proc.poll() is not None
        ]
        fleet.stop()
        deadlocks_after = stresskit.deadlocks_of_database(db)

        # -- gather ------------------------------------------------------------------------
        reports = []
        client_stderr = ""
        for proc, out, err in clients:
            client_stderr += err.read_text()
            if out.exists():
                reports.append(json.loads(out.read_text()))
            else:
                crashed.append(f"client exited {proc.returncode} without a report")
        ops: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        errors: list[dict[str, str]] = []
        rolled_back: list[int] = []
        for r in reports:
            ops.update(r["ops"])
            outcomes.update(r["outcomes"])
            errors.extend(r["errors"])
            rolled_back.extend(r["rolled_back_ids"])
        worker_logs = {w.pid: w.output for w in [*fleet.retired, *fleet.workers]}
        lost = {pid: stresskit.lost_lease_ids(log) for pid, log in worker_logs.items()}

        client_deadlocks = [e for e in errors if "deadlock" in e["text"].lower()]
        worker_deadlocks = [
            f"pid {pid}: {line}"
            for pid, log in worker_logs.items()
            for line in stresskit.deadlock_lines(log)
        ] + [f"client stderr: {line}" for line in stresskit.deadlock_lines(client_stderr)]
        unexpected = [e for e in errors if e not in client_deadlocks and not _expected_error(e)]
        stuck = stresskit.stuck(db)
        phantoms = stresskit.phantoms(db, rolled_back)
        reruns = stresskit.reruns(db, killed, lost)
        mismatches = stresskit.counter_mismatches(db)
        keys_twice = sampler.key_violations + stresskit.keys_held_twice(db)
        stopped = stresskit.stopped_messages(db)
        orphans = stresskit.orphans(db)
        group_sums = stresskit.group_sums_wrong(db)
        enqueued = int(db.value("SELECT count(*) FROM stress_enqueued"))
        by_queue = dict(db.rows("SELECT queue, count(*) FROM stress_exec_log GROUP BY queue"))
        off_queue = db.rows(
            "SELECT message_id, channel, queue, pid FROM stress_exec_log "
            "WHERE pid = ANY (%s) AND queue <> 'reports'",
            [sorted(reports_only)],
        )
        executions, messages_run = db.rows(
            "SELECT count(*), count(DISTINCT message_id) FROM stress_exec_log"
        )[0]
        figures: dict[str, Any] = {
            "seed": seed,
            "seconds": SECONDS,
            "load_seconds": round(load_seconds, 1),
            "drain_seconds": round(drain_seconds, 1),
            "clients": CLIENTS,
            "skipped_operations": SKIP,
            "workers": WORKERS,
            "operations": sum(ops.values()),
            "operations_by_kind": dict(sorted(ops.items())),
            "outcomes": dict(sorted(outcomes.items())),
            "messages_committed": enqueued,
            "messages_rolled_back": len(rolled_back),
            "executions": int(executions),
            "executions_by_queue": {q: int(n) for q, n in sorted(by_queue.items())},
            "executions_by_reports_only_worker": int(
                db.value(
                    "SELECT count(*) FROM stress_exec_log WHERE pid = ANY (%s)",
                    [sorted(reports_only)],
                )
            ),
            "ran_off_queue": len(off_queue),
            "messages_run": int(messages_run),
            "worker_kills": len(killed),
            "reruns_retry": reruns.retries,
            "reruns_after_kill": reruns.after_kill,
            "reruns_after_lease_expiry": reruns.after_lease_expiry,
            "ran_twice_unexplained": len(reruns.unexplained),
            "deadlocks_client_errors": len(client_deadlocks),
            "deadlocks_worker_log_lines": len(worker_deadlocks),
            "deadlocks_pg_stat": deadlocks_after - deadlocks_before,
            "left_after_drain": left,
            "unsettled_each_second_of_drain": drain_trace,
            "stuck_messages": sum(s["messages"] for s in stuck),
            "phantoms": sum(len(v) for v in phantoms.values()),
            "counter_mismatches": len(mismatches),
            "unique_keys_held_twice": len(keys_twice),
            "cancelled_messages": stopped.get("cancelled", 0),
            "aborted_messages": stopped.get("aborted", 0),
            "orphan_rows": sum(o["rows"] for o in orphans),
            "orphan_stat_rows": stresskit.orphan_stats(db),
            "cap_samples": sampler.samples,
            "cap_violations": len(sampler.violations),
            "cap_over_lowered_cap": sampler.over_cut_cap,
            "client_errors_expected": sum(map(_expected_error, errors)),
            "client_errors_unexpected": len(unexpected),
            "crashed": crashed,
        }
    finally:
        sampler.stop()
        for proc, _, _ in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        fleet.close()
        db.close()
        sampler.db.close()

    print("stress figures:\n" + json.dumps(figures, indent=2, default=str))
    target = os.environ.get("FAIRQUEUE_STRESS_REPORT")
    if target:
        Path(target).write_text(json.dumps(figures, indent=2, default=str) + "\n")

    # -- verdict: every failed invariant, with what it found ------------------------------
    failures: list[str] = []

    def fail(title: str, items: list[Any]) -> None:
        shown = "\n".join(f"    {json.dumps(i, default=str)}" for i in items[:10])
        more = f"\n    ... and {len(items) - 10} more" if len(items) > 10 else ""
        failures.append(f"{title}:\n{shown}{more}")

    deadlocks = figures["deadlocks_pg_stat"]
    if client_deadlocks or worker_deadlocks or deadlocks:
        fail(
            f"1. deadlocks (pg_stat_database: +{deadlocks})",
            [{"op": e["op"], "text": e["text"]} for e in client_deadlocks] + worker_deadlocks,
        )
    if stuck:
        wrong = {m["channel_id"] for m in mismatches} | {o["channel_id"] for o in orphans}
        for row in stuck:
            row["counters_wrong_or_orphan"] = row["channel_id"] in wrong
        fail(f"2. {figures['stuck_messages']} messages not terminal after the drain", stuck)
    if any(phantoms.values()):
        fail("2. messages stored or run without a committed enqueue", [phantoms])
    if reruns.unexplained:
        fail(f"3. {len(reruns.unexplained)} runs of a message ran again", reruns.unexplained)
    if sampler.violations or sampler.errors:
        fail(
            f"4. {len(sampler.violations)} samples above a channel's cap",
            sampler.violations + sampler.errors,
        )
    if mismatches:
        fail(f"5. {len(mismatches)} channels' counters differ from the real counts", mismatches)
    if orphans:
        fail("5. queue rows of channels that no longer exist", orphans)
    if group_sums:
        fail("5. channel groups whose sums differ from their channels'", group_sums)
    if keys_twice:
        fail("7. unique keys held by two messages at once", keys_twice)
    if off_queue:
        fail("8. the reports-only worker ran messages of other queues", off_queue)
    if set(figures["executions_by_queue"]) != {"default", "reports"}:
        fail("8. the mix did not run work of both queues", [figures["executions_by_queue"]])
    if unexpected:
        fail(
            f"6. {len(unexpected)} client operations failed unexpectedly",
            [
                {"op": e["op"], "type": e["type"], "text": e["text"], "where": _where(e)}
                for e in unexpected
            ],
        )
    if crashed:
        fail("processes that died on their own", crashed)
    if failures:
        logs = "\n".join(
            f"--- worker pid {pid} (end of its log) ---\n{stresskit.log_tail(log)}"
            for pid, log in worker_logs.items()
        )
        pytest.fail(
            f"stress seed {seed}: {len(failures)} invariants failed\n"
            + "\n".join(failures)
            + f"\n{logs}\n--- client stderr ---\n{client_stderr[-3000:]}",
            pytrace=False,
        )
