"""Prometheus metrics (optional extra: ``pip install django-fairqueue[prometheus]``).

Two sources, one registry (:data:`REGISTRY`):

* **Per channel, from the database**, read at scrape time by :class:`QueueCollector` from the
  counters plus pending deltas (two queries, whatever the backlog): ``fairqueue_channel_ready``,
  ``fairqueue_channel_scheduled``, ``fairqueue_channel_running``, ``fairqueue_channel_failed``
  (gauges; ``failed`` is the dead letters kept now), ``fairqueue_channel_max_concurrency``
  (channels with a cap) and ``fairqueue_channel_succeeded_total`` (messages processed
  successfully since the channel was created; a counter), each labelled ``channel`` (the name
  within its queue, as enqueue takes it) and ``queue``, so the channel ``acme`` of two queues
  makes two series. Any process can serve these, e.g. the web process through
  :func:`metrics_view`. For alerting and billing, per channel too (the first
  ``FAIRQUEUE_METRICS_MAX_CHANNELS`` by queue and name, a set that stays from scrape to scrape):
  the oldest ready age, paused, wait p50/p95, failed attempts of the last minutes by kind,
  retries waiting, and the usage counters (worker seconds, attempts, failures, timeouts).
* **Claim latency, per worker process**: the histogram ``fairqueue_claim_duration_seconds``,
  fed by the worker calling :func:`observe_claim` after each claim. It lives in the memory of
  the process that observes it, so scrape each worker (:func:`start_http_server` starts
  prometheus-client's exporter thread serving this registry), or run prometheus-client in
  multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).

Access to :func:`metrics_view` is **not public by default**. A request is served when it
carries ``Authorization: Bearer <token>`` matching the setting ``FAIRQUEUE_METRICS_TOKEN``
(compared in constant time), or comes from a signed-in staff user with the *view channel*
permission. Anything else gets 403 (401 with ``WWW-Authenticate`` when a token is configured
and the request presented none). Route it yourself::

    from django_fairqueue.metrics import metrics_view
    urlpatterns += [path("metrics/", metrics_view)]
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse

try:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client import start_http_server as _start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # tests/test_admin.py hides the package to check this message
    raise ImproperlyConfigured(
        "django_fairqueue.metrics needs prometheus-client: pip install django-fairqueue[prometheus]"
    ) from exc

from django_fairqueue import conf, stats
from django_fairqueue.db import channel_store, message_store, pg
from django_fairqueue.models import Channel
from django_fairqueue.observe import horizon, overview, usage
from django_fairqueue.queues import split_row_name
from django_fairqueue.runtime import worker_registry

__all__ = [
    "CLAIM_LATENCY",
    "PROCESS_REGISTRY",
    "REGISTRY",
    "QueueCollector",
    "metrics_view",
    "observe_claim",
    "start_http_server",
]

#: Content type of the text exposition format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: The setting holding the bearer token that grants access to :func:`metrics_view`.
TOKEN_SETTING = "FAIRQUEUE_METRICS_TOKEN"
#: The setting bounding the per-channel series of the alerting families (oldest ready age,
#: wait, paused, retrying, failures, usage), read and checked by
#: :func:`django_fairqueue.conf.metrics_max_channels`: at most this many channels, the first
#: by queue and name, so the set of series does not change from one scrape to the next while
#: the channels do not (a rule with ``for: 5m`` needs its series to stay). Beyond it the
#: aggregate over all (``channel="(all)"``, ``queue="(all)"``; no queue can be named so)
#: still covers every channel.
MAX_SETTING = "FAIRQUEUE_METRICS_MAX_CHANNELS"
#: The window of the wait, retry and failure figures (the per-minute statistics).
WINDOW_MINUTES = 5
ALL = "(all)"


class QueueCollector(Collector):
    """Per-channel gauges and counters, read from the database at each scrape."""

    def collect(self) -> Iterator[Metric]:
        counts = overview.all_counts()
        families = {
            "ready": GaugeMetricFamily(
                "fairqueue_channel_ready",
                "Messages ready to be claimed.",
                labels=["channel", "queue"],
            ),
            "scheduled": GaugeMetricFamily(
                "fairqueue_channel_scheduled",
                "Messages waiting for their run_at (delayed, or a retry's backoff).",
                labels=["channel", "queue"],
            ),
            "running": GaugeMetricFamily(
                "fairqueue_channel_running",
                "Messages claimed and running.",
                labels=["channel", "queue"],
            ),
            "failed": GaugeMetricFamily(
                "fairqueue_channel_failed",
                "Failed messages (dead letters) kept now.",
                labels=["channel", "queue"],
            ),
        }
        cap = GaugeMetricFamily(
            "fairqueue_channel_max_concurrency",
            "The channel's concurrency cap (channels without one are absent).",
            labels=["channel", "queue"],
        )
        succeeded = CounterMetricFamily(
            "fairqueue_channel_succeeded",
            "Messages that succeeded since the channel was created.",
            labels=["channel", "queue"],
        )
        for c in sorted(counts.values(), key=lambda c: c.name):
            labels = _labels(c.name)
            for attr, family in families.items():
                family.add_metric(labels, getattr(c, attr))
            if c.max_concurrency is not None:
                cap.add_metric(labels, c.max_concurrency)
            succeeded.add_metric(labels, c.succeeded)
        yield from families.values()
        yield cap
        yield succeeded
        views = worker_registry.workers()
        workers = GaugeMetricFamily(
            "fairqueue_workers",
            "Workers in the registry by state: alive, silent (beat late), dead, stopped.",
            labels=["state"],
        )
        for state in ("alive", "silent", "dead", "stopped"):
            workers.add_metric([state], sum(1 for v in views if v.state == state))
        yield workers
        yield from self._alerting(counts)

    def _alerting(self, counts: dict[int, overview.ChannelCounts]) -> Iterator[Metric]:
        """What to alert on: who starves (oldest ready age, waits), who is paused (so a paused
        tenant's age does not page anyone), who fails, stale leases; and who used how much.

        Per channel for a stable set: every channel up to MAX_SETTING, in queue and name order,
        each with a value at every scrape (an age of 0 with nothing ready), so a series never
        vanishes while its channel exists. Cardinality: one series per channel and family (the
        wait two, p50 and p95), like the counts above.
        """
        limit = conf.metrics_max_channels()
        now = pg.select_clock()
        since = channel_store.select_backlogged_oldest_ready()
        chosen = sorted(counts.values(), key=lambda c: _labels(c.name)[::-1])[:limit]
        ids = [c.id for c in chosen]
        age = GaugeMetricFamily(
            "fairqueue_oldest_ready_age_seconds",
            "How long the longest-waiting ready message has waited (0: nothing ready), per "
            f"channel and the longest of all as channel={ALL!r}.",
            labels=["channel", "queue"],
        )
        paused = GaugeMetricFamily(
            "fairqueue_channel_paused",
            "1 while the channel is paused (nothing of it is claimed), else 0.",
            labels=["channel", "queue"],
        )
        for c in chosen:
            ready_since = since.get(c.id)
            waited = max((now - ready_since).total_seconds(), 0.0) if ready_since else 0.0
            age.add_metric(_labels(c.name), waited)
            paused.add_metric(_labels(c.name), 1.0 if c.paused else 0.0)
        # a channel created since the counters were read is left for the next scrape
        oldest = min((t for cid, t in since.items() if cid in counts), default=None)
        age.add_metric([ALL, ALL], max((now - oldest).total_seconds(), 0.0) if oldest else 0.0)
        yield age
        yield paused
        wait = GaugeMetricFamily(
            "fairqueue_wait_seconds",
            f"Wait from ready to claimed over the last {WINDOW_MINUTES} minutes (p50, p95), per "
            "channel that claimed any then, and over all.",
            labels=["channel", "queue", "quantile"],
        )
        per_channel = stats.wait_by_channel(WINDOW_MINUTES, ids)
        overall = stats.wait_summary(WINDOW_MINUTES)
        for labels, summary in [
            *((_labels(counts[cid].name), s) for cid, s in sorted(per_channel.items())),
            ([ALL, ALL], overall),
        ]:
            for quantile, value in (("0.5", summary.p50_ms), ("0.95", summary.p95_ms)):
                if value is not None:
                    wait.add_metric([*labels, quantile], value / 1000)
        yield wait
        yield from self._per_channel_failures(chosen)
        yield from self._usage(chosen)
        window = stats.outcome_totals(WINDOW_MINUTES)
        for key, text in (
            # expired leases included (the rescuer counts them), and attempts past their time limit
            ("retried", "Attempts that failed and will be retried"),
            ("failed", "Messages that failed for good (new dead letters)"),
            (
                "timed_out",
                "Of the retried and failed attempts, those that ran out of time (past the "
                "task's time limit, or their lease expired and was rescued); the rest raised",
            ),
            ("succeeded", "Messages that succeeded"),
        ):
            family = GaugeMetricFamily(
                f"fairqueue_{key}_last_{WINDOW_MINUTES}m",
                f"{text}, over the last {WINDOW_MINUTES} minutes (all channels).",
            )
            family.add_metric([], window[key])
            yield family
        retrying = GaugeMetricFamily(
            "fairqueue_retrying",
            "Messages waiting out a retry's backoff after a failed attempt (all channels).",
        )
        scheduled = [c.id for c in counts.values() if c.scheduled > 0]
        retrying.add_metric([], sum(channel_store.select_channel_retrying(scheduled).values()))
        yield retrying
        stale = GaugeMetricFamily(
            "fairqueue_stale_leases",
            "Running messages whose lease has expired: their worker died or stalled, and they "
            "wait for a live worker's rescuer.",
        )
        stale.add_metric([], message_store.select_stale_lease_count())
        yield stale
        aborting = GaugeMetricFamily(
            "fairqueue_aborts_pending",
            "Running messages asked to abort that have not stopped yet (each ends aborted "
            "within a heartbeat and ABORT_GRACE, unless its worker is gone).",
        )
        aborting.add_metric([], message_store.select_abort_pending_count())
        yield aborting

    def _per_channel_failures(self, chosen: list[overview.ChannelCounts]) -> Iterator[Metric]:
        """Failed attempts of the last minutes and retries waiting, per channel (0 when none)."""
        window = stats.window_stats(WINDOW_MINUTES, channel_ids=[c.id for c in chosen])
        failing = stats.failing_of(window)
        retrying = channel_store.select_channel_retrying([c.id for c in chosen if c.scheduled > 0])
        failures = GaugeMetricFamily(
            f"fairqueue_channel_failures_last_{WINDOW_MINUTES}m",
            f"Failed attempts over the last {WINDOW_MINUTES} minutes, retried or dead-lettered, "
            "by kind: raised (the task raised) or timeout (past its time limit, or its lease "
            "expired and was rescued).",
            labels=["channel", "queue", "kind"],
        )
        waiting = GaugeMetricFamily(
            "fairqueue_channel_retrying",
            "Messages waiting out a retry's backoff after a failed attempt.",
            labels=["channel", "queue"],
        )
        none = stats.Failing()
        for c in chosen:
            labels = _labels(c.name)
            f = failing.get(c.id, none)
            failures.add_metric([*labels, "raised"], f.failures)
            failures.add_metric([*labels, "timeout"], f.timeouts)
            waiting.add_metric(labels, retrying.get(c.id, 0))
        yield failures
        yield waiting

    def _usage(self, chosen: list[overview.ChannelCounts]) -> Iterator[Metric]:
        """Per-tenant usage since each channel was first recorded (never pruned: counters)."""
        totals = usage.totals()
        families = {
            "worker_ms": CounterMetricFamily(
                "fairqueue_channel_worker_seconds",
                "Worker time the channel's attempts ran, in seconds.",
                labels=["channel", "queue"],
            ),
            "attempts": CounterMetricFamily(
                "fairqueue_channel_attempts",
                "Attempts settled: succeeded, failed for good, or failed and retried.",
                labels=["channel", "queue"],
            ),
            "failures": CounterMetricFamily(
                "fairqueue_channel_failures",
                "Attempts that failed (raised, past their time limit, or their lease expired).",
                labels=["channel", "queue"],
            ),
            "timeouts": CounterMetricFamily(
                "fairqueue_channel_timeouts",
                "Of the failed attempts, those that ran out of time.",
                labels=["channel", "queue"],
            ),
        }
        for c in chosen:
            total = totals.get(c.id)
            for attr, family in families.items():
                value = getattr(total, attr) if total is not None else 0
                family.add_metric(_labels(c.name), value / 1000 if attr == "worker_ms" else value)
        yield from families.values()


def _labels(row_name: str) -> list[str]:
    """The ``channel`` and ``queue`` label values of a channel row: the channel's name within
    its queue (as enqueue takes it), and the queue."""
    queue, name = split_row_name(row_name)
    return [name, queue]


# -- the xmin horizon ----------------------------------------------------------------------


class HorizonCollector(Collector):
    """What holds the queue database's xmin horizon back (a long transaction slows every
    claim): the oldest transaction's age, and the holders past ``HORIZON_WARN_AFTER``."""

    def collect(self) -> Iterator[Metric]:
        age = GaugeMetricFamily(
            "fairqueue_xmin_horizon_seconds",
            "Seconds since the oldest transaction holding the queue database's xmin horizon "
            "began (0: none); while it is open VACUUM keeps every row version the queue writes.",
        )
        age.add_metric([], horizon.oldest_age())
        yield age
        held = GaugeMetricFamily(
            "fairqueue_xmin_horizon_holder_xid_age",
            "Transactions, prepared transactions and inactive replication slots holding the "
            "xmin horizon past FAIRQUEUE['HORIZON_WARN_AFTER']: how many transactions back "
            "each holds it (fairqueue status names them with their query).",
            labels=["kind", "pid", "name"],
        )
        for h in horizon.holders():
            held.add_metric([h.kind, "" if h.pid is None else str(h.pid), h.name], h.xid_age or 0)
        yield held


#: The queue as the database sees it (served by :func:`metrics_view`, from any process).
REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(QueueCollector())
REGISTRY.register(HorizonCollector())

#: What only this process knows (served by :func:`start_http_server` in a worker): a web
#: process never claims, so its view would export an always-empty histogram.
PROCESS_REGISTRY = CollectorRegistry(auto_describe=False)

CLAIM_LATENCY = Histogram(
    "fairqueue_claim_duration_seconds",
    "Duration of one claim_messages call (round trip included), in this worker process.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=PROCESS_REGISTRY,
)


def observe_claim(seconds: float) -> None:
    """Record one claim's duration (the worker calls this after each claim)."""
    CLAIM_LATENCY.observe(seconds)


def start_http_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Serve :data:`PROCESS_REGISTRY` from this process on ``addr:port`` (a daemon thread); for
    worker processes, whose claim latency no other process sees. Bind to a private address:
    this endpoint has no access control of its own."""
    return _start_http_server(port, addr=addr, registry=PROCESS_REGISTRY)


def _allowed(request: HttpRequest) -> tuple[bool, bool]:
    """(allowed, a token is configured and none was presented)."""
    token = getattr(settings, TOKEN_SETTING, None)
    header = request.headers.get("Authorization", "")
    if token:
        scheme, _, presented = header.partition(" ")
        if scheme.lower() == "bearer" and presented:
            return hmac.compare_digest(presented.strip().encode(), str(token).encode()), False
    user = getattr(request, "user", None)
    opts = Channel._meta
    if (
        user is not None
        and user.is_active
        and user.is_staff
        and (
            user.has_perm(f"{opts.app_label}.view_channel")
            or user.has_perm(f"{opts.app_label}.change_channel")
        )
    ):
        return True, False
    return False, bool(token) and not header


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition of :data:`REGISTRY` (see the module for access)."""
    allowed, challenge = _allowed(request)
    if not allowed:
        response = HttpResponse(
            "metrics: authentication required\n", status=401 if challenge else 403
        )
        if challenge:
            response["WWW-Authenticate"] = 'Bearer realm="fairqueue metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE)
