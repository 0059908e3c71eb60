"""OpenTelemetry: the enqueuing trace travels in the message; each run is a span linked to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind, StatusCode

from django_fairqueue import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.models import Message
from django_fairqueue.testing import drain
from tests import fairtasks

pytestmark = pytest.mark.django_db


class _Recorder(SpanProcessor):
    """Keeps the spans that end while a test of this module records (the provider is global
    for the process and outlives these tests)."""

    def __init__(self) -> None:
        self.recording = False
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        if self.recording:
            self.spans.append(span)


_RECORDER = _Recorder()


@pytest.fixture
def spans() -> Iterator[list[ReadableSpan]]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "another tracer provider was set first"
    if _RECORDER not in provider._active_span_processor._span_processors:
        provider.add_span_processor(_RECORDER)
    _RECORDER.spans.clear()
    _RECORDER.recording = True
    try:
        yield _RECORDER.spans
    finally:
        _RECORDER.recording = False


def _runs(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith("fairqueue run ")]


def test_a_run_is_a_span_linked_to_the_request_that_enqueued_it(spans: Any) -> None:
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /upload/") as request:
        message_id = enqueue(fairtasks.add, 2, 3, channel="acme")
    payload = Message.objects.get(pk=message_id).payload
    assert set(payload) == {"args", "kwargs", "trace"}
    assert payload["args"] == [2, 3]
    assert f"{request.get_span_context().trace_id:032x}" in payload["trace"]["traceparent"]

    assert drain() == 1
    (run,) = _runs(spans)
    assert run.name == "fairqueue run tests.fair.add"
    assert run.kind == SpanKind.CONSUMER
    # a trace of its own, linked to the request's span
    assert run.context.trace_id != request.get_span_context().trace_id
    assert run.parent is None
    (link,) = run.links
    assert link.context.trace_id == request.get_span_context().trace_id
    assert link.context.span_id == request.get_span_context().span_id
    assert run.attributes is not None
    assert run.attributes["fairqueue.channel"] == "acme"
    assert run.attributes["fairqueue.task"] == "tests.fair.add"
    assert run.attributes["fairqueue.attempt"] == 1
    assert run.attributes["messaging.message.id"] == str(message_id)
    assert run.status.status_code == StatusCode.UNSET


def test_a_batch_carries_the_context_and_a_failing_run_ends_in_error(spans: Any) -> None:
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("import"):
        ids = enqueue_many(
            EnqueueRequest(fairtasks.boom, ("bad",), channel=f"t{n}") for n in range(3)
        )
    assert all("trace" in m.payload for m in Message.objects.filter(pk__in=ids))
    with override_settings(FAIRQUEUE={"RETRY_BACKOFF_BASE": 0}):
        assert drain() == 6  # two attempts each
    runs = _runs(spans)
    assert len(runs) == 6
    assert {r.attributes["fairqueue.attempt"] for r in runs if r.attributes} == {1, 2}
    for run in runs:
        assert run.status.status_code == StatusCode.ERROR
        assert [e.name for e in run.events] == ["exception"]
        assert len(run.links) == 1


def test_without_a_current_span_or_with_tracing_off_nothing_is_carried(spans: Any) -> None:
    plain = enqueue(fairtasks.add, 1, 1, channel="acme")
    assert set(Message.objects.get(pk=plain).payload) == {"args", "kwargs"}
    tracer = trace.get_tracer("tests")
    with (
        override_settings(FAIRQUEUE={"TRACING": False}),
        tracer.start_as_current_span("request"),
    ):
        off = enqueue(fairtasks.add, 1, 2, channel="acme")
        assert drain() == 2
    assert set(Message.objects.get(pk=off).payload) == {"args", "kwargs"}
    assert _runs(spans) == []
    assert drain() == 0
    # on again: a message enqueued without a span still runs in a span, with no link
    enqueue(fairtasks.add, 1, 3, channel="acme")
    assert drain() == 1
    (run,) = _runs(spans)
    assert run.links == ()


def test_a_malformed_carrier_is_ignored(spans: Any) -> None:
    message_id = enqueue(fairtasks.add, 4, 4, channel="acme")
    Message.objects.filter(pk=message_id).update(
        payload={"args": [4, 4], "kwargs": {}, "trace": {"traceparent": "00-nonsense", "x": 5}}
    )
    assert drain() == 1
    (run,) = _runs(spans)
    assert run.links == ()
    assert Message.objects.get(pk=message_id).result == 8


def test_runs_make_no_span_until_a_tracer_provider_is_configured(
    spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_fairqueue.observe import tracing

    configured = trace.get_tracer_provider()
    # as in a process where nothing configured OpenTelemetry: the API's proxy, or a no-op
    for unconfigured in (trace.ProxyTracerProvider(), trace.NoOpTracerProvider()):
        monkeypatch.setattr(trace, "get_tracer_provider", lambda p=unconfigured: p)
        enqueue(fairtasks.add, 1, 1, channel="acme")
        assert drain() == 1
        assert tracing._tracer() is None
    assert _runs(spans) == []
    # configured later: the next run has its span, and runs share one tracer
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: configured)
    enqueue(fairtasks.add, 1, 2, channel="acme")
    enqueue(fairtasks.add, 1, 3, channel="acme")
    assert drain() == 2
    assert len(_runs(spans)) == 2
    assert tracing._tracer() is tracing._tracer() is not None
