"""Show the channels as the admin lists them: backlog, running against the cap, failures, age.

Per channel: ready, delayed (by the sender), retrying (waiting out a retry's backoff after a
failed attempt), running against the cap, failures and timeouts of the last 5 minutes (the task
raised; it ran out of time or lost its lease), dead letters, the oldest ready message's age and
the messages finished in the last 5 minutes.

One line per channel (the first --limit, default 20, in --sort order, default most ready first;
a channel is its name within its queue, and the QUEUE column says which), then, when channel
groups exist, one line per group (the --limit with most ready first: its channels, ready and
running summed over them, its cap, weight and rate limit), then the totals over all channels,
per queue when there are several, the live workers, and a warning naming any transaction or
replication slot that has held the xmin horizon for longer than HORIZON_WARN_AFTER (it slows
every claim; docs/reliability.md says what to do). Name a CHANNEL (with --queue QUEUE
outside the default queue) to see it alone, with why its messages wait; --queue QUEUE without
a CHANNEL lists that queue's channels, groups and totals only. --json prints one
JSON document for scripts; --watch redraws every SECONDS (default 2) until Ctrl-C. The figures
come from the counters, bounded index probes and the per-minute statistics: cheap on a busy
queue (docs/howto/observability.md).
"""

# A subcommand module of the ``fairqueue`` command: add_arguments(parser), handle(options, stdout).

from __future__ import annotations

import argparse
import time
from datetime import datetime
from typing import Any, TextIO

from django.core.management.base import CommandError
from django.db import connections

from django_fairqueue import conf, limits, stats
from django_fairqueue.cli import channel_name
from django_fairqueue.cli.terminal import aligned, cut, json_text, printable
from django_fairqueue.db import channel_store, pg
from django_fairqueue.observe import horizon, moments, overview, waiting
from django_fairqueue.queues import DEFAULT_QUEUE, split_row_name, validate_queue_name
from django_fairqueue.runtime import worker_registry

#: Longest channel name printed in the table (the JSON has it whole).
_NAME_WIDTH = 40


def _short_name(name: str) -> str:
    """A channel, group or queue name, control characters escaped, cut to the table's name
    column."""
    return cut(printable(name), _NAME_WIDTH)


def _cap(max_concurrency: int | None) -> str:
    return "-" if max_concurrency is None else f"{max_concurrency:,}"


_WATCH_DEFAULT = 2.0
_WATCH_MIN, _WATCH_MAX = 0.1, 86400.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "channel",
        nargs="?",
        type=channel_name,
        metavar="CHANNEL",
        help="Show this channel alone, with why its messages wait.",
    )
    parser.add_argument(
        "--queue",
        type=_queue,
        metavar="QUEUE",
        help=(
            "The queue of CHANNEL (default: the default queue); without CHANNEL, list only "
            "this queue's channels, groups and totals."
        ),
    )
    parser.add_argument(
        "--sort",
        choices=overview.SORTS,
        default="backlog",
        help="Order of the channels: most ready first (default), longest-waiting first (age), "
        "by name, most running, most failed.",
    )
    parser.add_argument(
        "--limit", type=limits.limit_option, default=20, help="Most channels to list (default: 20)."
    )
    parser.add_argument("--json", action="store_true", help="Print JSON.")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=_WATCH_DEFAULT,
        type=_seconds,
        metavar="SECONDS",
        help=f"Redraw every SECONDS (default {_WATCH_DEFAULT:g}) until interrupted.",
    )


def handle(options: dict[str, Any], stdout: TextIO) -> None:
    interval: float | None = options["watch"]
    if interval is None:
        _write(stdout, _render(options))
        return
    clear = "\x1b[H\x1b[2J" if _isatty(stdout) and not options["json"] else ""
    checked = False  # the queue's name, at the first redraw only (its workers may restart)
    try:
        while True:
            text = _render(options, check_queue=not checked)
            checked = True
            if not options["json"]:
                stamp = moments.local(moments.now()).strftime("%Y-%m-%d %H:%M:%S %Z")
                text = f"{stamp}, every {interval:g}s (Ctrl-C stops)\n\n{text}"
            _write(stdout, clear + text if clear else text + ("" if options["json"] else "\n"))
            # Between redraws, like a worker between passes: a connection the server closed
            # (restart, idle timeout) is replaced instead of failing the next redraw. Never
            # inside a transaction (a caller's atomic block, a test case).
            for conn in connections.all(initialized_only=True):
                if not conn.in_atomic_block:
                    conn.close_if_unusable_or_obsolete()
            time.sleep(interval)
    except KeyboardInterrupt:
        return


def snapshot(
    sort: str = "backlog",
    limit: int = 20,
    now: datetime | None = None,
    queue: str | None = None,
    *,
    check_queue: bool = True,
) -> dict[str, Any]:
    """What ``status --json`` prints. Ages are measured on the database's clock (``now``),
    which stamped the messages; the finished counts' minutes are the workers' own clocks.
    With ``queue``, the channels, groups and totals are that queue's only (the workers are
    every worker's); ``check_queue``: refuse a queue nothing knows (see below)."""
    now = now or pg.select_clock()
    views = worker_registry.workers()  # beats age on the database's clock, which stamped them
    alive = worker_registry.live(views)
    counts = overview.all_counts()
    if queue is not None:
        every = counts
        counts = {k: c for k, c in every.items() if split_row_name(c.name)[0] == queue}
        known = {DEFAULT_QUEUE, *(split_row_name(c.name)[0] for c in every.values())}
        known.update(q for v in alive for q in v.queues or ())
        if check_queue and queue not in known:
            # as for a channel that does not exist: a queue named wrong must not pass for an
            # idle one (one a live worker serves, or the default, may be empty)
            raise CommandError(
                f"no channel in queue {queue!r}, and no live worker serves it; the queues: "
                + ", ".join(sorted(known))
            )
    ids = overview.ranked_ids(sort, limit, counts=counts)
    retrying = channel_store.select_channel_retrying(
        [c.id for c in counts.values() if c.scheduled > 0]
    )
    minutes = overview.FINISHED_MINUTES
    recent = stats.window_stats(minutes)
    if queue is not None:
        recent = {k: w for k, w in recent.items() if k in counts}
    failing = stats.failing_of(recent).values()
    return {
        "generated_at": now.isoformat(),
        "sort": sort,
        "totals": {
            **overview.totals(counts),
            "retrying": sum(retrying.values()),
            f"failures_last_{minutes}m": sum(f.failures for f in failing),
            f"timeouts_last_{minutes}m": sum(f.timeouts for f in failing),
        },
        "workers": {
            "live": len(alive),
            "threads": sum(v.concurrency for v in alive),
            "running": sum(v.running for v in alive),
            "dead": sum(1 for v in views if v.state == "dead"),
        },
        "finished_last_5m": sum(stats.finished_of(recent).values()),
        "queues": _queues(counts.values(), alive, queue),
        "channels": [_in_queue(row.as_dict(now)) for row in overview.rows(ids)],
        **_groups(limit, queue),
        # the long transactions (and slots) that hold VACUUM back and slow every claim
        "xmin_horizon": [horizon.as_dict(h) for h in horizon.holders()],
    }


def _in_queue(row: dict[str, Any]) -> dict[str, Any]:
    """A channel's or group's dict with its name within its queue, and its queue."""
    queue, name = split_row_name(row["name"])
    return {**row, "name": name, "queue": queue}


def _queues(
    counts: Any, alive: list[worker_registry.WorkerView], asked: str | None = None
) -> dict[str, dict[str, int]]:
    """Per queue: its channels, their ready and running messages, and the live workers that
    serve it (those of every queue, and those started with --queues naming it); the queue
    ``asked`` for is listed even without a channel."""
    out: dict[str, dict[str, int]] = {}
    if asked is not None:
        out[asked] = {"channels": 0, "ready": 0, "running": 0}
    for c in counts:
        q = out.setdefault(split_row_name(c.name)[0], {"channels": 0, "ready": 0, "running": 0})
        q["channels"] += 1
        q["ready"] += c.ready
        q["running"] += c.running
    for name, q in out.items():
        q["live_workers"] = sum(1 for v in alive if v.queues is None or name in v.queues)
    return dict(sorted(out.items()))


def _groups(limit: int, queue: str | None = None) -> dict[str, Any]:
    """The channel groups (of ``queue``, or all) with most ready first (the first ``limit``),
    and how many exist. Their ready and running are the sums over their channels as last
    folded."""
    groups = channel_store.select_group_state()
    if queue is not None:
        groups = [g for g in groups if split_row_name(g.name)[0] == queue]
    groups.sort(key=lambda g: (-g.ready, -g.running, split_row_name(g.name)[::-1]))
    return {
        "groups_total": len(groups),
        "groups": [
            {
                "name": split_row_name(g.name)[1],
                "queue": split_row_name(g.name)[0],
                "channels": g.channels,
                "claimable_channels": g.claimable,
                "ready": g.ready,
                "running": g.running,
                "max_concurrency": g.max_concurrency,
                "weight": g.weight,
                "release_interval_seconds": g.release_interval.total_seconds(),
            }
            for g in groups[:limit]
        ],
    }


def _render(options: dict[str, Any], *, check_queue: bool = True) -> str:
    now = pg.select_clock()  # the clock that stamped what is aged here
    if options.get("channel") is not None:
        queue = options.get("queue") or "default"
        return _render_channel(options["channel"], options["json"], now, queue)
    data = snapshot(
        options["sort"], options["limit"], now, options.get("queue"), check_queue=check_queue
    )
    if options["json"]:
        return json_text(data)
    return table(data)


def _render_channel(name: str, as_json: bool, now: datetime, queue: str) -> str:
    found = channel_store.select_channel_ids_in_queues([name], [queue])
    if not found:
        raise CommandError(f"no channel named {name!r} in queue {queue!r}")
    ((cid, _queue, _name),) = found
    (row,) = overview.rows([cid])
    why = waiting.channel(cid)
    if as_json:
        return json_text(
            {**_in_queue(row.as_dict(now)), "why_waiting": why.text, "cause": why.cause}
        )
    single = {
        "channels": [_in_queue(row.as_dict(now))],
        "sort": "name",
        "totals": overview.totals({}),
        "finished_last_5m": row.finished_recent,
        "workers": None,
    }
    return table(single, summary=False) + f"\nWhy it waits: {printable(why.text)}"


def table(data: dict[str, Any], *, summary: bool = True) -> str:
    """The snapshot as aligned text: one line per channel, then the totals."""
    minutes = overview.FINISHED_MINUTES
    header = (
        "CHANNEL",
        "QUEUE",
        "READY",
        "DELAYED",
        "RETRYING",
        "RUNNING",
        f"FAILS {minutes}M",
        f"TIMEOUTS {minutes}M",
        "DEAD",
        "OLDEST",
        f"DONE {minutes}M",
        "WEIGHT",
        "INTERVAL",
        "PAUSED",
    )
    lines: list[tuple[str, ...]] = [header]
    for c in data["channels"]:
        name = _short_name(c["name"])
        cap = _cap(c["max_concurrency"])
        interval = c["release_interval_seconds"]
        lines.append(
            (
                name,
                _short_name(c.get("queue", "default")),
                f"{c['ready']:,}",
                f"{c['delayed']:,}",
                f"{c['retrying']:,}",
                f"{c['running']:,}/{cap}",
                f"{c[f'failures_last_{minutes}m']:,}",
                f"{c[f'timeouts_last_{minutes}m']:,}",
                f"{c['failed']:,}",
                overview.format_age(c["oldest_ready_age_seconds"]),
                f"{c[f'finished_last_{minutes}m']:,}",
                str(c["weight"]),
                f"{interval:g}s" if interval else "-",
                "yes" if c["paused"] else "",
            )
        )
    out = aligned(lines, right=range(2, len(header)))  # names left, figures right
    if not summary:
        return "\n".join(out)
    if data.get("groups"):
        out.append("")
        out.extend(_group_table(data["groups"]))
    t = data["totals"]
    shown = len(data["channels"])
    if not shown:
        out = ["No channels."]
    out.append("")
    out.append(
        f"{_count(t['channels'], 'channel')} "
        f"({shown:,} shown, sorted by {data['sort']}; "
        f"{t['backlogged']:,} with ready messages, {t['paused']:,} paused): "
        f"{t['ready']:,} ready, {t['scheduled'] - t['retrying']:,} delayed, "
        f"{t['retrying']:,} retrying, {t['running']:,} running, "
        f"{_count(t['failed'], 'dead letter')}; "
        f"in the last {minutes} minutes {data['finished_last_5m']:,} finished, "
        f"{t[f'failures_last_{minutes}m']:,} failures, {t[f'timeouts_last_{minutes}m']:,} "
        "timeouts."
    )
    if len(data.get("queues") or {}) > 1:
        out.append(
            "Queues: "
            + "; ".join(
                f"{name} {_count(q['channels'], 'channel')}, "
                f"{q['ready']:,} ready, "
                f"{q['running']:,} running, {_count(q['live_workers'], 'live worker')}"
                for name, q in data["queues"].items()
            )
            + "."
        )
    if data.get("groups_total"):
        out.append(
            f"{_count(data['groups_total'], 'channel group')} ({len(data['groups']):,} shown, most "
            "ready first); a group's channels are named <group>/<channel>."
        )
    w = data["workers"]
    out.append(
        f"{_count(w['live'], 'live worker')} ({_count(w['threads'], 'thread')}, "
        f"{w['running']:,} running)"
        + (f", {w['dead']:,} dead" if w["dead"] else "")
        + " (manage.py fairqueue workers lists them)."
    )
    if not w["live"] and (t["ready"] or t["running"]):
        out.append(
            "WARNING: no live worker: nothing will run."
            + (
                " Messages shown as running belong to dead workers and are requeued once their "
                "leases expire and a worker rescues them."
                if t["running"]
                else ""
            )
        )
    unserved = [
        name
        for name, q in (data.get("queues") or {}).items()
        if q["ready"] and not q["live_workers"]
    ]
    if w["live"] and unserved:
        out.append(
            f"WARNING: no live worker serves queue{'s' if len(unserved) > 1 else ''} "
            f"{', '.join(unserved)}: its ready messages wait until a worker of every queue, or "
            "one started with --queues naming it, runs (manage.py fairqueue workers shows "
            "each worker's queues)."
        )
    out.extend(_horizon_lines(data.get("xmin_horizon") or []))
    return "\n".join(out)


def _horizon_lines(holders: list[dict[str, Any]]) -> list[str]:
    """The warning naming what holds the xmin horizon back, one line per holder."""
    if not holders:
        return []
    after = overview.format_age(conf.get().HORIZON_WARN_AFTER)
    return [
        f"WARNING: {len(holders)} old transaction{'s' if len(holders) > 1 else ''} or slot"
        f"{'s' if len(holders) > 1 else ''} (over {after}) "
        f"hold{'' if len(holders) > 1 else 's'} the xmin horizon: VACUUM keeps "
        "every row version the queue writes, and claims slow down until they end "
        '(docs/reliability.md, "A long transaction"):',
        *(f"  {h['text']}" for h in holders),
    ]


def _group_table(groups: list[dict[str, Any]]) -> list[str]:
    header = ("GROUP", "QUEUE", "CHANNELS", "READY", "RUNNING", "WEIGHT", "INTERVAL")
    lines: list[tuple[str, ...]] = [header]
    for g in groups:
        name = _short_name(g["name"])
        cap = _cap(g["max_concurrency"])
        interval = g["release_interval_seconds"]
        lines.append(
            (
                name,
                _short_name(g.get("queue", "default")),
                f"{g['channels']:,}",
                f"{g['ready']:,}",
                f"{g['running']:,}/{cap}",
                str(g["weight"]),
                f"{interval:g}s" if interval else "-",
            )
        )
    return aligned(lines, right=range(2, len(header)))  # names left, figures right


def _isatty(stream: TextIO) -> bool:
    target = getattr(stream, "_out", stream)  # Django's OutputWrapper
    isatty = getattr(target, "isatty", None)
    return bool(isatty and isatty())


def _write(stdout: TextIO, text: str) -> None:
    stdout.write(text + "\n")
    stdout.flush()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not _WATCH_MIN <= value <= _WATCH_MAX:  # NaN fails too; inf would crash the sleep
        raise argparse.ArgumentTypeError(
            f"must be {_WATCH_MIN:g} to {_WATCH_MAX:g} seconds, got {text!r}"
        )
    return value


def _queue(text: str) -> str:
    try:
        return validate_queue_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 live worker", "2 live workers"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
