"""What tests/test_stress.py measures and checks: the cap sampler and the invariant queries.

Everything reads the queue tables with raw SQL on its own psycopg connection (the counters are
table columns, whatever the ``Channel`` model declares).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.faults.harness import Db

#: Per capped channel, what runs now (messages and work batches) against its cap, and when the
#: newest of those runs was claimed and the cap last edited.
OVER_CAP = """
WITH running AS (
    SELECT m.channel_id, m.claimed_at AS t, m.id AS message_id, NULL::bigint AS batch_id
    FROM fairqueue_message m WHERE m.state = 'running'
    UNION ALL
    SELECT b.channel_id, b.started_at, NULL, b.id
    FROM fairqueue_work_batch b WHERE b.state = 'running'
), per AS (
    SELECT channel_id, count(*) AS n, max(t) AS newest,
           array_agg(message_id ORDER BY t) FILTER (WHERE message_id IS NOT NULL) AS messages,
           count(batch_id) AS batches
    FROM running GROUP BY channel_id
)
SELECT c.id, c.name, c.max_concurrency, per.n, per.batches, per.newest,
       e.at AS edited, e.how, per.messages, clock_timestamp(), c.running_count,
       (SELECT coalesce(sum(d.running), 0) FROM fairqueue_channel_delta d
        WHERE d.channel_id = c.id) AS running_deltas
FROM per JOIN fairqueue_channel c ON c.id = per.channel_id
LEFT JOIN LATERAL (
    SELECT e.at, e.how FROM stress_limit_edit e WHERE e.channel = c.name ORDER BY e.at DESC LIMIT 1
) e ON true
WHERE c.max_concurrency IS NOT NULL AND per.n > c.max_concurrency
"""


#: Channel groups running more messages of their channels than the group's cap (the stress
#: test never edits a group's cap, so any is a violation).
GROUP_OVER_CAP = """
SELECT g.name, g.max_concurrency, count(*), array_agg(m.id ORDER BY m.id)
FROM fairqueue_message m
JOIN fairqueue_channel c ON c.id = m.channel_id
JOIN fairqueue_channel_group g ON g.id = c.group_id
WHERE m.state = 'running' AND g.max_concurrency IS NOT NULL
GROUP BY g.id
HAVING count(*) > g.max_concurrency
"""

#: Channel groups whose sums differ from their channels' columns (kept by a trigger).
GROUP_SUMS_WRONG = """
SELECT g.name, g.ready_count, g.running_count, g.claimable,
       coalesce(sum(c.ready_count), 0), coalesce(sum(c.running_count), 0),
       count(c.id) FILTER (WHERE c.ready_count > 0 AND NOT c.paused
           AND (c.max_concurrency IS NULL OR c.running_count < c.max_concurrency))
FROM fairqueue_channel_group g
LEFT JOIN fairqueue_channel c ON c.group_id = g.id
GROUP BY g.id
HAVING (g.ready_count, g.running_count, g.claimable)
    IS DISTINCT FROM (coalesce(sum(c.ready_count), 0), coalesce(sum(c.running_count), 0),
                      count(c.id) FILTER (WHERE c.ready_count > 0 AND NOT c.paused
                          AND (c.max_concurrency IS NULL
                               OR c.running_count < c.max_concurrency)))
"""


def group_sums_wrong(db: Db) -> list[dict[str, Any]]:
    """Channel groups whose ready, running or claimable differ from the sums over their
    channels."""
    return [
        {"group": r[0], "group (ready, running, claimable)": r[1:4], "channels": r[4:7]}
        for r in db.rows(GROUP_SUMS_WRONG)
    ]


@dataclass
class Sampler:
    """Every ``every`` seconds, one snapshot of running work per capped channel.

    A channel above its cap is a violation when the newest of its runs was claimed after the
    cap was last edited: that claim saw the cap and every other run, and still took a slot. A
    channel above a cap lowered after its runs were claimed is only noted (``over_cut_cap``):
    nothing preempts running work.
    """

    db: Db
    every: float = 0.05
    samples: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    over_cut_cap: int = 0
    #: unique keys seen held by two messages of a channel at once (the index forbids it)
    key_violations: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="cap-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                rows = self.db.rows(OVER_CAP)
                self.key_violations.extend(keys_held_twice(self.db))
            except Exception as exc:  # noted; a sampler that cannot read is a failure too
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.db.reconnect()
                continue
            self.samples += 1
            try:
                for group, cap, n, ids in self.db.rows(GROUP_OVER_CAP):
                    self.violations.append(
                        {"group": group, "cap": cap, "running": n, "message_ids": ids}
                    )
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.db.reconnect()
            for cid, name, cap, n, batches, newest, edited, how, messages, at, *rc in rows:
                if edited is not None and newest <= edited:
                    self.over_cut_cap += 1
                    continue
                self.violations.append(
                    {
                        "channel": name,
                        "channel_id": cid,
                        "cap": cap,
                        "running": n,
                        "running_batches": batches,
                        "newest_claim": str(newest),
                        "cap_edited": str(edited),
                        "last_edit": how,
                        "message_ids": messages,
                        # what the claim believed: the column plus its pending deltas
                        "running_recorded": f"column {rc[0]} + deltas {rc[1]}",
                        "at": str(at),
                    }
                )


# ------------------------------------------------------------------------------------------
# Checks after the drain

#: Counters (row + pending deltas) against the real counts, per channel.
COUNTER_MISMATCHES = """
SELECT c.id, c.name,
       c.ready_count, c.scheduled_count, c.running_count, c.failed_count,
       coalesce(d.ready, 0), coalesce(d.scheduled, 0), coalesce(d.running, 0),
       coalesce(d.failed, 0),
       coalesce(t.ready, 0), coalesce(t.scheduled, 0),
       coalesce(t.running, 0) + coalesce(b.running, 0), coalesce(t.failed, 0)
FROM fairqueue_channel c
LEFT JOIN LATERAL (
    SELECT sum(x.ready) AS ready, sum(x.scheduled) AS scheduled, sum(x.running) AS running,
           sum(x.failed) AS failed
    FROM fairqueue_channel_delta x WHERE x.channel_id = c.id
) d ON true
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE m.state = 'ready') AS ready,
           count(*) FILTER (WHERE m.state = 'scheduled') AS scheduled,
           count(*) FILTER (WHERE m.state = 'running') AS running,
           count(*) FILTER (WHERE m.state = 'failed') AS failed
    FROM fairqueue_message m WHERE m.channel_id = c.id
) t ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS running FROM fairqueue_work_batch w
    WHERE w.channel_id = c.id AND w.state = 'running'
) b ON true
ORDER BY c.name
"""

COUNTERS = ("ready", "scheduled", "running", "failed")


def counter_mismatches(db: Db) -> list[dict[str, Any]]:
    """Channels whose counters (column + pending deltas) differ from the real counts."""
    out = []
    for row in db.rows(COUNTER_MISMATCHES):
        cid, name = row[0], row[1]
        column, delta, real = row[2:6], row[6:10], row[10:14]
        recorded = [int(a) + int(b) for a, b in zip(column, delta, strict=True)]
        if recorded != [int(r) for r in real]:
            out.append(
                {
                    "channel": name,
                    "channel_id": cid,
                    **{
                        k: f"recorded {rec} (column {col} + deltas {dl}), real {r}"
                        for k, rec, col, dl, r in zip(
                            COUNTERS, recorded, column, delta, real, strict=True
                        )
                        if rec != r
                    },
                }
            )
    return out


def keys_held_twice(db: Db) -> list[dict[str, Any]]:
    """Unique keys held by more than one message of a channel (the index and the hold rows
    forbid it), and holders of scope 'active' their key's hold row does not name (a running
    one would not keep its key)."""
    return [
        {"channel_id": cid, "unique_key": key, "ids": list(ids)}
        for cid, key, ids in db.rows(
            "SELECT channel_id, unique_key, array_agg(id ORDER BY id) FROM fairqueue_message "
            "WHERE unique_key IS NOT NULL AND (state IN ('ready', 'scheduled') "
            "OR (state = 'running' AND unique_scope = 'active')) "
            "GROUP BY 1, 2 HAVING count(*) > 1"
        )
    ] + [
        {"channel_id": cid, "unique_key": key, "ids": [mid], "unnamed_by_hold_row": True}
        for cid, key, mid in db.rows(
            "SELECT m.channel_id, m.unique_key, m.id FROM fairqueue_message m "
            "WHERE m.unique_key IS NOT NULL AND m.unique_scope = 'active' "
            "AND m.state IN ('ready', 'scheduled', 'running') AND NOT EXISTS ("
            "SELECT FROM fairqueue_unique_hold h WHERE h.channel_id = m.channel_id "
            "AND h.unique_key = m.unique_key AND h.message_id = m.id)"
        )
    ]


def stopped_messages(db: Db) -> dict[str, int]:
    """Messages cancelled and aborted (and aborted ones whose run log shows a later run)."""
    rows = db.rows(
        "SELECT state, count(*) FROM fairqueue_message "
        "WHERE state IN ('cancelled', 'aborted') GROUP BY state"
    )
    return {state: int(n) for state, n in rows}


ORPHANS = """
SELECT 'fairqueue_message', x.channel_id, count(*), array_agg(x.id ORDER BY x.id)
FROM fairqueue_message x
WHERE NOT EXISTS (SELECT 1 FROM fairqueue_channel c WHERE c.id = x.channel_id)
GROUP BY x.channel_id
UNION ALL
SELECT 'fairqueue_channel_delta', x.channel_id, count(*), array_agg(x.id ORDER BY x.id)
FROM fairqueue_channel_delta x
WHERE NOT EXISTS (SELECT 1 FROM fairqueue_channel c WHERE c.id = x.channel_id)
GROUP BY x.channel_id
UNION ALL
SELECT 'fairqueue_work_batch', x.channel_id, count(*), array_agg(x.id ORDER BY x.id)
FROM fairqueue_work_batch x
WHERE NOT EXISTS (SELECT 1 FROM fairqueue_channel c WHERE c.id = x.channel_id)
GROUP BY x.channel_id
"""


def orphans(db: Db) -> list[dict[str, Any]]:
    """Queue rows whose channel row is gone."""
    return [
        {"table": t, "channel_id": cid, "rows": int(n), "ids": list(ids)[:20]}
        for t, cid, n, ids in db.rows(ORPHANS)
    ]


def orphan_stats(db: Db) -> int:
    """Statistics rows of deleted channels (a figure only: pruned after a day)."""
    return int(
        db.value(
            "SELECT count(*) FROM fairqueue_channel_stat s WHERE NOT EXISTS "
            "(SELECT 1 FROM fairqueue_channel c WHERE c.id = s.channel_id)"
        )
    )


def unsettled(db: Db) -> int:
    """Messages still waiting or running."""
    return int(
        db.value(
            "SELECT count(*) FROM fairqueue_message "
            "WHERE state IN ('ready', 'scheduled', 'running')"
        )
    )


def stuck(db: Db) -> list[dict[str, Any]]:
    """Messages not terminal after the drain, by channel and state, with the channel's limits
    and scheduler state (why no claim took them)."""
    rows = db.rows(
        """
        SELECT coalesce(c.name, '(no channel row)'), m.channel_id, m.state, count(*),
               array_agg(m.id ORDER BY m.id),
               min(m.run_at) FILTER (WHERE m.state = 'scheduled'),
               c.paused, c.max_concurrency, c.release_interval, c.next_turn_at, c.ready_count,
               c.running_count, clock_timestamp()
        FROM fairqueue_message m LEFT JOIN fairqueue_channel c ON c.id = m.channel_id
        WHERE m.state IN ('ready', 'scheduled', 'running')
        GROUP BY 1, 2, 3, 7, 8, 9, 10, 11, 12 ORDER BY 1, 3
        """
    )
    return [
        {
            "channel": n,
            "channel_id": cid,
            "state": s,
            "messages": int(k),
            "ids": list(ids)[:20],
            "earliest_run_at": str(due) if due else None,
            "channel_row": f"paused {paused}, cap {cap}, interval {interval}, next turn "
            f"{turn} (now {now}), ready_count {ready}, running_count {running}",
        }
        for n, cid, s, k, ids, due, paused, cap, interval, turn, ready, running, now in rows
    ]


def phantoms(db: Db, rolled_back: Iterable[int]) -> dict[str, list[int]]:
    """Messages that exist or ran without a committed enqueue (a rolled-back one, say)."""
    unknown = db.rows(
        "SELECT m.id FROM fairqueue_message m "
        "WHERE NOT EXISTS (SELECT 1 FROM stress_enqueued e WHERE e.message_id = m.id) "
        "ORDER BY m.id LIMIT 50"
    )
    ran = db.rows(
        "SELECT DISTINCT l.message_id FROM stress_exec_log l "
        "WHERE NOT EXISTS (SELECT 1 FROM stress_enqueued e WHERE e.message_id = l.message_id) "
        "ORDER BY 1 LIMIT 50"
    )
    back = db.rows(
        "SELECT e.message_id FROM stress_enqueued e WHERE e.message_id = ANY (%s::bigint[])",
        [list(rolled_back)],
    )
    return {
        "stored_without_committed_enqueue": [r[0] for r in unknown],
        "ran_without_committed_enqueue": [r[0] for r in ran],
        "rolled_back_but_committed": [r[0] for r in back],
    }


#: Every run of a message after its first, with the run before it.
RERUNS = """
WITH l AS (
    SELECT l.*,
           lag(l.id) OVER w AS prev_id, lag(l.pid) OVER w AS prev_pid,
           lag(l.attempt) OVER w AS prev_attempt, lag(l.outcome) OVER w AS prev_outcome,
           lag(l.finished_at) OVER w AS prev_finished
    FROM stress_exec_log l
    WINDOW w AS (PARTITION BY l.message_id ORDER BY l.started_at, l.id)
)
SELECT message_id, channel, prev_pid, prev_attempt, prev_outcome, prev_finished,
       pid, attempt, started_at, seen_error_type, seen_error_message
FROM l WHERE prev_id IS NOT NULL
ORDER BY message_id, started_at
"""

_LOST_IDS = re.compile(r"(?:lease was lost|lost the lease).*?ids \[([0-9, ]*)\]")


def lost_lease_ids(log: str) -> set[int]:
    """Message ids a worker's log says it lost the lease of (at most 20 per line)."""
    ids: set[int] = set()
    for match in _LOST_IDS.finditer(log):
        ids.update(int(x) for x in match.group(1).split(",") if x.strip())
    return ids


@dataclass
class Reruns:
    retries: int = 0  # the run before raised: a retry
    after_kill: int = 0  # the run before was by a worker killed on purpose
    after_lease_expiry: int = 0  # the queue rescued the message from an expired lease
    unexplained: list[dict[str, Any]] = field(default_factory=list)


def reruns(db: Db, killed: set[int], lost: dict[int, set[int]]) -> Reruns:
    """Sort every rerun of a message by what explains it; what nothing explains ran twice."""
    out = Reruns()
    for (
        mid,
        channel,
        prev_pid,
        prev_attempt,
        prev_outcome,
        prev_finished,
        pid,
        attempt,
        started,
        seen_type,
        seen_message,
    ) in db.rows(RERUNS):
        if prev_outcome == "raised":
            out.retries += 1
        elif prev_pid in killed:
            out.after_kill += 1
        elif (
            seen_type == "LeaseExpired"
            and f"during attempt {prev_attempt} of" in (seen_message or "")
        ) or mid in lost.get(prev_pid, set()):
            out.after_lease_expiry += 1
        else:
            out.unexplained.append(
                {
                    "message_id": mid,
                    "channel": channel,
                    "first": f"pid {prev_pid} attempt {prev_attempt} {prev_outcome or 'unfinished'}"
                    f" (finished {prev_finished})",
                    "again": f"pid {pid} attempt {attempt} started {started}",
                    "last_error_seen": seen_type,
                }
            )
    return out


def deadlocks_of_database(db: Db) -> int:
    db.value("SELECT pg_stat_clear_snapshot()::text")
    return int(
        db.value("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    )


def wait_unsettled(db: Db, stall: float, limit: float) -> tuple[float, int, list[int]]:
    """Wait until nothing is ready, scheduled or running, giving up when that count has not
    gone down for ``stall`` seconds or after ``limit`` seconds in all; returns (seconds waited,
    left, the count once a second)."""
    began = time.monotonic()
    best, best_at = unsettled(db), began
    trace = [best]
    while True:
        left = unsettled(db)
        now = time.monotonic()
        if now - began >= len(trace):
            trace.append(left)
        if left < best:
            best, best_at = left, now
        if left == 0 or now - best_at > stall or now - began > limit:
            return now - began, left, trace
        time.sleep(0.25)


def log_tail(log: str, chars: int = 3000) -> str:
    """The end of a worker's log without the lines of runs that fail on purpose."""
    kept = [line for line in log.splitlines() if "fails on purpose" not in line]
    return "\n".join(kept)[-chars:]


_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", re.MULTILINE)


def deadlock_lines(text: str) -> list[str]:
    """Log records (a line and its continuation lines: the error's DETAIL names the cycle)
    that mention a deadlock."""
    starts = [m.start() for m in _RECORD_START.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    records = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    return [r.strip()[:2000] for r in records if "deadlock" in r.lower()]
