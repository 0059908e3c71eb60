"""The fast constructor of frozen dataclasses: what it builds is what the class builds."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import uuid
from datetime import UTC, datetime

import pytest

from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.frozen import builder
from django_fairqueue.worker.config import Outcome, new_outcome


def claimed_row() -> tuple[object, ...]:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    return (7, 3, "acme", "tests.fair.add", {"args": [1], "kwargs": {}}, 0, 1, 5, False,
            uuid.uuid4(), now, now, now)  # fmt: skip


def test_a_built_instance_is_one_the_class_would_build() -> None:
    row = claimed_row()
    built, made = builder(ClaimedMessage)(*row), ClaimedMessage(*row)
    assert type(built) is ClaimedMessage
    assert built == made and repr(built) == repr(made)
    no_payload = (*row[:4], None, *row[5:])  # (a dict payload makes neither hashable)
    assert hash(builder(ClaimedMessage)(*no_payload)) == hash(ClaimedMessage(*no_payload))
    assert built.queue == "default"  # defaults apply
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.id = 8  # type: ignore[misc]
    assert dataclasses.replace(built, queue="q").queue == "q"
    assert pickle.loads(pickle.dumps(built)) == made
    assert copy.copy(built) == made and copy.deepcopy(built) == made
    outcome = new_outcome(built, "succeeded", result=3, duration=0.5)
    assert outcome == Outcome(made, "succeeded", result=3, duration=0.5)
    assert type(outcome) is Outcome and outcome.error is None and not outcome.timed_out


def test_it_checks_arguments_as_the_class_does() -> None:
    build = builder(ClaimedMessage)
    with pytest.raises(TypeError, match="missing"):
        build(*claimed_row()[:-1])
    with pytest.raises(TypeError, match="unexpected"):
        new_outcome(None, "succeeded", nonsense=1)


def test_only_frozen_dataclasses_with_slots_are_accepted() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("negative")

    for cls in (NoSlots, Mutable, Checked):
        with pytest.raises(TypeError, match="not a frozen dataclass"):
            builder(cls)
