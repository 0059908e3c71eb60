"""Companions of a worker (django_fairqueue.worker.extensions): the queue's plug-in point for an
installed app that runs beside ``runfairworker`` (the Spark pipeline app's ``--pipelines``).
A stand-in extension shows the contract: its options, its start and stop around the worker,
its options passed on to supervised processes, a refusal before the worker starts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import CommandParser

from django_fairqueue.management.commands.runfairworker import Command
from django_fairqueue.worker import extensions, supervisor
from django_fairqueue.worker.config import WorkerConfig

EVENTS: list[str] = []


class Recorder(extensions.Companion):
    def __init__(self, label: str) -> None:
        self.label = label
        EVENTS.append(f"start {label}")

    def stop(self) -> None:
        EVENTS.append(f"stop {self.label}")


class Echo(extensions.WorkerExtension):
    name = "echo"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--echo", metavar="LABEL")

    def child_flags(self, options: Mapping[str, Any]) -> list[str]:
        return ["--echo", options["echo"]] if options.get("echo") else []

    def start(self, options: Mapping[str, Any], config: WorkerConfig) -> Recorder | None:
        label = options.get("echo")
        if label is None:
            return None
        if label == "bad":
            raise ValueError("--echo: 'bad' is refused")
        return Recorder(f"{label} for {config.worker_id}")


class Broken(extensions.WorkerExtension):
    """Registered after Echo: its refusal must stop the companion Echo already started."""

    name = "broken"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--broken", action="store_true")

    def start(self, options: Mapping[str, Any], config: WorkerConfig) -> None:
        if options.get("broken"):
            raise ValueError("--broken: cannot start")


@pytest.fixture
def echo() -> Iterator[None]:
    EVENTS.clear()
    extensions.register(Echo())
    extensions.register(Broken())
    yield
    extensions.unregister("echo")
    extensions.unregister("broken")


@pytest.mark.django_db(transaction=True)
def test_a_companion_starts_before_the_worker_and_stops_after_it(echo: None) -> None:
    call_command("runfairworker", "--burst", "--worker-id", "w1", "--echo", "hello", "-v", "0")
    assert EVENTS == ["start hello for w1", "stop hello for w1"]
    EVENTS.clear()
    call_command("runfairworker", "--burst", "--worker-id", "w1", "-v", "0")
    assert EVENTS == []  # not asked for: not started


@pytest.mark.django_db(transaction=True)
def test_a_refusal_stops_the_worker_before_it_starts_and_stops_what_started(echo: None) -> None:
    with pytest.raises(CommandError, match="--echo: 'bad' is refused"):
        call_command("runfairworker", "--burst", "--echo", "bad", "-v", "0")
    assert EVENTS == []
    with pytest.raises(CommandError, match="--broken: cannot start"):
        call_command("runfairworker", "--burst", "--worker-id", "w2", "--echo", "x", "--broken")
    assert EVENTS == ["start x for w2", "stop x for w2"]


def test_supervised_workers_get_the_extensions_options(echo: None) -> None:
    parser = Command().create_parser("manage.py", "runfairworker")
    options = vars(parser.parse_args(["--echo", "hi", "--processes", "2"]))
    assert supervisor.child_flags(options)[-2:] == ["--echo", "hi"]
    assert vars(parser.parse_args(supervisor.child_flags(options)))["echo"] == "hi"


def test_an_extension_needs_a_name() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        extensions.register(extensions.WorkerExtension())
