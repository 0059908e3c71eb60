"""OpenTelemetry tracing: the enqueuing trace travels in the message, each run is a span.

Optional: it works when ``opentelemetry-api`` is installed (``pip install
'django-fairqueue[otel]'``) and ``FAIRQUEUE['TRACING']`` is true (the default); without the
package every function here is a no-op that costs one attribute lookup, and until the
application sets a tracer provider a run makes no span (nothing would record it).

* At enqueue, when a span is current (the request's, if the web server is instrumented), its
  context is injected with the globally configured propagator (W3C ``traceparent`` by default)
  into the message's payload, under the ``trace`` key beside ``args`` and ``kwargs``.
* The worker runs each attempt inside a span ``fairqueue run <task name>`` of kind CONSUMER. It
  starts a trace of its own and carries a *link* to the enqueuing span rather than being its
  child: a message may run hours after the request ended (delays, retries, a backlog), and a
  child would stretch the request's trace over all of that. Trace viewers follow the link.
  Attributes: ``messaging.system`` (``fairqueue``), ``messaging.operation`` (``process``),
  ``messaging.message.id``, ``fairqueue.channel``, ``fairqueue.task``, ``fairqueue.attempt``,
  ``fairqueue.max_attempts``. A task that raises records the exception on the span and sets
  its status to ERROR; spans and their export are the application's OpenTelemetry SDK's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from django_fairqueue import conf

try:  # the `otel` extra
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace

    _INSTALLED = True
except ImportError:  # pragma: no cover - exercised by installs without the extra
    _INSTALLED = False

if TYPE_CHECKING:
    from django_fairqueue.db.message_store import ClaimedMessage

__all__ = ["CARRIER_KEY", "carrier", "enabled", "run_span"]

#: The payload key that carries the enqueuing context (a dict of text headers).
CARRIER_KEY = "trace"
#: Longest carrier accepted from a payload, in headers and characters per header: a payload is
#: data anyone who can enqueue writes, and a propagator should not parse megabytes of it.
_MAX_HEADERS = 8
_MAX_HEADER_CHARS = 512


def enabled() -> bool:
    """Whether tracing is on: the package is installed and the setting allows it."""
    return _INSTALLED and conf.get().TRACING


def carrier() -> dict[str, str] | None:
    """The current span's context as text headers, for a message's payload; None when tracing
    is off or no span is current (then the payload carries nothing)."""
    if not enabled() or not trace.get_current_span().get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers or None


def _carried_link(payload: Any) -> list[Any]:
    """A link to the span a payload's carrier names (none if it names none or is malformed)."""
    carried = payload.get(CARRIER_KEY) if isinstance(payload, Mapping) else None
    if not isinstance(carried, Mapping) or len(carried) > _MAX_HEADERS:
        return []
    headers = {
        k: v
        for k, v in carried.items()
        if isinstance(k, str) and isinstance(v, str) and len(v) <= _MAX_HEADER_CHARS
    }
    span_context = trace.get_current_span(propagate.extract(headers)).get_span_context()
    return [trace.Link(span_context)] if span_context.is_valid else []


#: What :func:`run_span` returns when no span is made: one reusable no-op block.
_NO_SPAN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
#: The tracer of the provider last seen, as (provider, tracer): a provider's ``get_tracer``
#: builds a new tracer on every call.
_tracer_of: tuple[Any, Any] = (None, None)


def _tracer() -> Any:
    """The tracer for a run's span, or None when no span would be recorded: tracing is off, or
    no tracer provider is configured (the API's proxy with nothing behind it, or a no-op
    provider), whose spans are never recorded nor exported. Asked for every run, so a provider
    configured after the worker started gets the runs from then on."""
    if not enabled():
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    global _tracer_of
    seen, tracer = _tracer_of
    if seen is not provider:
        tracer = provider.get_tracer("django_fairqueue")
        _tracer_of = (provider, tracer)
    return tracer


def run_span(message: ClaimedMessage) -> contextlib.AbstractContextManager[None]:
    """Run the block (one attempt of ``message``) inside its span; a no-op when tracing is off
    or no tracer provider is configured. An exception leaving the block is recorded on the
    span, which then ends with ERROR."""
    tracer = _tracer()
    if tracer is None:
        return _NO_SPAN
    return _span(tracer, message)


@contextlib.contextmanager
def _span(tracer: Any, message: ClaimedMessage) -> Iterator[None]:
    with tracer.start_as_current_span(
        f"fairqueue run {message.task_name}",
        context=otel_context.Context(),  # a trace of its own (see the module's docstring)
        kind=trace.SpanKind.CONSUMER,
        links=_carried_link(message.payload),
        attributes={
            "messaging.system": "fairqueue",
            "messaging.operation": "process",
            "messaging.message.id": str(message.id),
            "fairqueue.channel": message.channel,
            "fairqueue.task": message.task_name,
            "fairqueue.attempt": message.attempts,
            "fairqueue.max_attempts": message.max_attempts,
        },
    ):
        yield
