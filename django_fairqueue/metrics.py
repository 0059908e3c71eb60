"""Prometheus metrics (optional extra: ``pip install django-fairqueue[prometheus]``).

Two sources, one registry (:data:`REGISTRY`):

* **Per channel, from the database**, read at scrape time by :class:`QueueCollector` from the
  counters plus pending deltas (two queries, whatever the backlog): ``fairqueue_channel_ready``,
  ``fairqueue_channel_scheduled``, ``fairqueue_channel_running``, ``fairqueue_channel_failed``
  (gauges; ``failed`` is the dead letters kept now), ``fairqueue_channel_max_concurrency``
  (channels with a cap) and ``fairqueue_channel_succeeded_total`` (messages processed
  successfully since the channel was created; a counter), each labelled ``channel``. Any
  process can serve these, e.g. the web process through :func:`metrics_view`.
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

from django_fairqueue import overview, registry
from django_fairqueue.models import Channel

__all__ = [
    "CLAIM_LATENCY",
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


class QueueCollector(Collector):
    """Per-channel gauges and counters, read from the database at each scrape."""

    def collect(self) -> Iterator[Metric]:
        counts = overview.all_counts()
        families = {
            "ready": GaugeMetricFamily(
                "fairqueue_channel_ready", "Messages ready to be claimed.", labels=["channel"]
            ),
            "scheduled": GaugeMetricFamily(
                "fairqueue_channel_scheduled",
                "Messages waiting for their run_at (delayed, or a retry's backoff).",
                labels=["channel"],
            ),
            "running": GaugeMetricFamily(
                "fairqueue_channel_running", "Messages claimed and running.", labels=["channel"]
            ),
            "failed": GaugeMetricFamily(
                "fairqueue_channel_failed",
                "Failed messages (dead letters) kept now.",
                labels=["channel"],
            ),
        }
        cap = GaugeMetricFamily(
            "fairqueue_channel_max_concurrency",
            "The channel's concurrency cap (channels without one are absent).",
            labels=["channel"],
        )
        succeeded = CounterMetricFamily(
            "fairqueue_channel_succeeded",
            "Messages that succeeded since the channel was created.",
            labels=["channel"],
        )
        for c in sorted(counts.values(), key=lambda c: c.name):
            for attr, family in families.items():
                family.add_metric([c.name], getattr(c, attr))
            if c.max_concurrency is not None:
                cap.add_metric([c.name], c.max_concurrency)
            succeeded.add_metric([c.name], c.succeeded)
        yield from families.values()
        yield cap
        yield succeeded
        views = registry.workers()
        workers = GaugeMetricFamily(
            "fairqueue_workers",
            "Workers in the registry by state: alive, silent (beat late), dead, stopped.",
            labels=["state"],
        )
        for state in ("alive", "silent", "dead", "stopped"):
            workers.add_metric([state], sum(1 for v in views if v.state == state))
        yield workers


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(QueueCollector())

CLAIM_LATENCY = Histogram(
    "fairqueue_claim_duration_seconds",
    "Duration of one claim_messages call (round trip included), in this worker process.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)


def observe_claim(seconds: float) -> None:
    """Record one claim's duration (the worker calls this after each claim)."""
    CLAIM_LATENCY.observe(seconds)


def start_http_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Serve :data:`REGISTRY` from this process on ``addr:port`` (a daemon thread); for worker
    processes, whose claim latency no other process sees. Bind to a private address: this
    endpoint has no access control of its own."""
    return _start_http_server(port, addr=addr, registry=REGISTRY)


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
