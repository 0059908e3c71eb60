"""Fairness by time (``FAIRQUEUE['FAIRNESS'] = 'time'``): channels share worker time.

The ordering tests are deterministic: one claim of one message at a time, settled at once
through the real settle path with a recorded run time. A settlement's run time is bounded by
the database's clock since the claim, so each test first moves the message's ``claimed_at``
back by the time it is to have run (as if it had), then settles it reporting that time, and
folds the deltas (what the workers' maintenance loop does about once a second).
Concurrent claimers are at the end.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.db import connection, transaction
from django.test import RequestFactory
from django.test.utils import override_settings

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.conf import load
from django_fairqueue.db import channel_store, integrity_store, message_store
from django_fairqueue.models import Channel, ChannelGroup
from tests import factories as f
from tests.test_claim_concurrency import run_threads

LEASE = timedelta(minutes=5)
TIME = {"FAIRNESS": "time"}


@pytest.fixture(autouse=True)
def _by_time() -> Iterator[None]:
    with override_settings(FAIRQUEUE={**_base(), **TIME}):
        yield


def _base() -> dict[str, Any]:
    from django.conf import settings

    return dict(settings.FAIRQUEUE)


def claim(limit: int = 1, **kwargs: Any) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="test-worker", **kwargs)


def backdate(ids: list[int], seconds: float) -> None:
    """As if the messages had been claimed ``seconds`` ago (they ran that long)."""
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_message SET claimed_at = claimed_at - %s * interval '1 second' "
            "WHERE id = ANY (%s)",
            [seconds, ids],
        )


def run(
    durations: dict[str, float], claims: int, *, limit: int = 1, **filters: Any
) -> tuple[Counter, Counter]:
    """``claims`` claims (with ``claim_messages``'s ``filters``), each settled at once with its
    channel's duration; returns the worker time and the count per channel."""
    spent: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for _ in range(claims):
        got = claim(limit, **filters)
        assert got, "a claim came back empty while every channel had work"
        for m in got:
            backdate([m.id], durations[m.channel])
        done = message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got],
            run_seconds=[durations[m.channel] for m in got],
        )
        assert done == {m.id for m in got}
        for m in got:
            spent[m.channel] += durations[m.channel]
            counts[m.channel] += 1
        f.fold_all()
    return spent, counts


def vtime(name: str) -> float:
    with connection.cursor() as cur:
        cur.execute("SELECT vtime FROM fairqueue_channel WHERE name = %s", [name])
        (value,) = cur.fetchone()
    return float(value)


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


# ------------------------------------------------------------------------------------------------
# The setting


def test_the_setting_takes_count_or_time_only() -> None:
    assert load({}).FAIRNESS == "time"  # the default
    assert load({"FAIRNESS": "count"}).FAIRNESS == "count"
    assert load({"FAIRNESS": "time"}).FAIRNESS == "time"
    with pytest.raises(ValueError, match=r"FAIRNESS.*must be one of"):
        load({"FAIRNESS": "seconds"})
    with pytest.raises(ValueError, match="fairness must be one of"):
        claim(1, fairness="fifo")


# ------------------------------------------------------------------------------------------------
# Ordering


@pytest.mark.django_db(transaction=True)
def test_heavy_and_light_channels_get_equal_worker_time_not_equal_counts() -> None:
    f.enqueue_spread({"heavy": 100, "light": 1000, "medium": 200})
    durations = {"heavy": 0.2, "light": 0.005, "medium": 0.05}
    spent, counts = run(durations, 400)
    # While all three stay backlogged, their worker time differs by at most about one task of
    # the longest kind (plus its first estimate, charged before any run time was known).
    assert max(spent.values()) - min(spent.values()) <= 2 * 0.2 + 1e-9, spent
    assert jain(list(spent.values())) > 0.99, spent
    assert counts["light"] > 10 * counts["heavy"], counts


@pytest.mark.django_db(transaction=True)
def test_by_count_the_same_workload_splits_counts_not_time() -> None:
    """The control: the same run by count gives equal counts and very unequal time."""
    f.enqueue_spread({"heavy": 100, "light": 100})
    durations = {"heavy": 0.2, "light": 0.005}
    with override_settings(FAIRQUEUE={**_base(), "FAIRNESS": "count"}):
        spent, counts = run(durations, 100)
    assert abs(counts["heavy"] - counts["light"]) <= 1, counts
    assert jain(list(spent.values())) < 0.6, spent


@pytest.mark.django_db(transaction=True)
def test_weights_divide_the_charge() -> None:
    f.enqueue_spread({"gold": 400, "plain": 400})
    f.set_limits(["gold"], weight=3)
    durations = {"gold": 0.1, "plain": 0.1}
    spent, counts = run(durations, 200)
    share = spent["gold"] / spent["plain"]
    assert 2.7 <= share <= 3.3, (spent, counts)
    # unequal durations: still 3:1 in time
    f.enqueue_spread({"gold2": 400, "plain2": 400})
    f.set_limits(["gold2"], weight=3)
    with connection.cursor() as cur:  # leave only the second pair claimable
        cur.execute("UPDATE fairqueue_channel SET paused = true WHERE name IN ('gold', 'plain')")
    spent, counts = run({"gold2": 0.02, "plain2": 0.15}, 300)
    share = spent["gold2"] / spent["plain2"]
    assert 2.5 <= share <= 3.5, (spent, counts)


@pytest.mark.django_db(transaction=True)
def test_a_claim_charges_the_mean_in_advance_and_the_settlement_corrects_it() -> None:
    f.enqueue("heavy", 20)
    run({"heavy": 0.2}, 5)
    before = vtime("heavy")
    got = claim(1)
    # charged in advance: about the mean run time (0.2 s) before anything settles
    assert vtime("heavy") == pytest.approx(before + 0.2, abs=0.01)
    backdate([got[0].id], 0.5)
    message_store.complete_messages([(got[0].id, got[0].lease_token, None)], run_seconds=[0.5])
    f.fold_all()
    # corrected: 0.5 ran, not 0.2 (the mean is corrected with what the claim charged)
    assert vtime("heavy") == pytest.approx(before + 0.5, abs=0.03)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("grouped", [False, True])
def test_released_messages_give_the_advance_charge_back(grouped: bool) -> None:
    """The channel's tag, and its group's (which the claim charged too)."""
    channel = ("acme", "heavy") if grouped else "heavy"
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=channel) for i in range(20))
    name = "acme/heavy" if grouped else "heavy"
    run({name: 0.2}, 5)

    def tags() -> tuple[float, float]:
        return vtime(name), group_vtime("acme") if grouped else 0.0

    before = tags()
    got = claim(3, quantum=3)
    assert vtime(name) > before[0] + 0.5
    if grouped:
        assert group_vtime("acme") > before[1] + 0.5
    assert message_store.release_messages([(m.id, m.lease_token) for m in got]) == {
        m.id for m in got
    }
    f.fold_all()
    assert tags() == pytest.approx(before, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# No banked credit


@pytest.mark.django_db(transaction=True)
def test_a_channel_idle_while_others_ran_comes_back_level_not_ahead() -> None:
    f.enqueue("alice", 1)
    run({"alice": 0.01}, 1)  # alice exists, has run once, and goes idle
    f.enqueue_spread({"bob": 400, "carol": 400})
    run({"bob": 0.1, "carol": 0.1}, 200)  # 20 s of worker time while alice was away
    f.enqueue("alice", 100)
    f.fold_all()
    assert vtime("alice") >= min(vtime("bob"), vtime("carol")) - 1e-9
    # Back level: alice gets her third, not the 10 s she "missed".
    _spent, counts = run({"alice": 0.1, "bob": 0.1, "carol": 0.1}, 30)
    assert 8 <= counts["alice"] <= 12, counts


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("held_low_by", ["a rate limit", "slow start", "another queue"])
def test_a_flow_the_claim_cannot_serve_now_does_not_hold_the_virtual_time_down(
    held_low_by: str,
) -> None:
    """A claimable channel whose tag stays low for a reason that is not banked service (rate
    limited, in slow start, in a queue nobody serves) was the smallest tag, and a new channel
    was lifted to it: it came back far ahead of the backlogged ones and took every claim."""
    f.enqueue_spread({"bob": 400, "carol": 400})
    run({"bob": 0.01, "carol": 0.01}, 2)  # both measured
    if held_low_by == "another queue":
        enqueue_many([EnqueueRequest(f.NOOP, channel="low", queue="reports")] * 5)
    else:
        f.enqueue("low", 5)
    if held_low_by == "a rate limit":
        Channel.objects.filter(name="low").update(release_interval=timedelta(hours=1))
        run({"low": 0.01, "bob": 0.01, "carol": 0.01}, 3)  # low's one release, then an hour
    elif held_low_by == "slow start":
        low_id = channel_store.select_channel_ids(["low"])["low"]
        (first,) = claim(1, only_channel_ids=[low_id])  # slow-starting until it settles
    run({"bob": 0.1, "carol": 0.1}, 100, queues=["default"])  # 10 s while low stays put
    low = Channel.objects.get(name__endswith="low").name  # (in "reports": its row's name)
    assert vtime(low) < 1 < min(vtime("bob"), vtime("carol"))
    f.enqueue("alice", 100)
    f.fold_all()
    assert vtime("alice") >= min(vtime("bob"), vtime("carol")) - 1e-9
    # level: alice gets her third of the next claims, not all of them
    _spent, counts = run({"alice": 0.1, "bob": 0.1, "carol": 0.1}, 30, queues=["default"])
    assert 8 <= counts["alice"] <= 12, counts
    if held_low_by == "slow start":
        # and low itself, once its first run time folds, comes back level too
        backdate([first.id], 0.01)
        message_store.complete_messages([(first.id, first.lease_token, None)], run_seconds=[0.01])
        f.fold_all()
        assert vtime(low) >= min(vtime("bob"), vtime("carol"), vtime("alice")) - 1e-9


def claims_until(name: str, limit: int, most: int) -> int:
    """Claims of ``limit`` (settled at once, run times of 0.1 ms) until one gives ``name`` a
    message; returns how many it took, or ``most + 1`` if none of ``most`` did."""
    for n in range(1, most + 1):
        got = claim(limit)
        assert got, "a claim came back empty while channels had work"
        message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got], run_seconds=[0.0001] * len(got)
        )
        if any(m.channel == name for m in got):
            return n
    return most + 1


@pytest.mark.django_db(transaction=True)
def test_a_channel_waking_behind_an_over_charged_one_is_served_within_one_claim() -> None:
    """A new channel of near-instant tasks is charged the default estimate (10 ms a message)
    until its settlements fold, then drops back by what it was over-charged. A channel that
    was lifted to its tag before the drop and went idle must not come back that far behind:
    at a charge of microseconds per message, that was millions of the other's messages (a
    flooded queue starved the newcomer's next burst)."""
    f.enqueue("bob", 400)
    f.measured()  # (not slow-starting: bob has run before)
    running = [m for _ in range(10) for m in claim(10)]
    assert len(running) == 100  # charged 10 ms each, nothing settled yet: bob at 1 s
    f.enqueue("alice", 1)  # lifted to bob's tag, served by the next claim
    assert claims_until("alice", 10, 2) <= 2
    message_store.complete_messages(
        [(m.id, m.lease_token, None) for m in running], run_seconds=[0.0001] * len(running)
    )
    f.fold_all()  # bob's 0.1 ms runs fold: his tag drops back by about a second
    assert vtime("bob") < 0.1 < vtime("alice")
    f.enqueue("alice", 1)
    # served within one round: the next claim (or the one after, on a tie)
    assert claims_until("alice", 10, 2) <= 2, (vtime("alice"), vtime("bob"))
    f.fold_all()
    assert vtime("alice") <= vtime("bob") + 0.01


@pytest.mark.django_db(transaction=True)
def test_a_new_channel_is_charged_its_own_run_time_from_its_second_claim() -> None:
    """A channel's first settlements wake the claim, which folds them: the default estimate
    (10 ms) is charged for its first message only (slow start), not until the maintenance
    loop folds."""
    f.enqueue("quick", 50)
    (first,) = claim(1)
    backdate([first.id], 0.001)
    message_store.complete_messages([(first.id, first.lease_token, None)], run_seconds=[0.001])
    before = vtime("quick")
    assert len(claim(5, quantum=5)) == 5  # folds the settlement first (a woken fold)
    # charged 1 ms a message: the default's 10 ms given back for the first, 5 x 1 ms for these
    assert vtime("quick") == pytest.approx(before - (0.01 - 0.001) + 5 * 0.001, abs=2e-4)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("grouped", [False, True])
def test_a_new_tenant_of_long_tasks_gets_one_worker_until_its_first_result(grouped: bool) -> None:
    """Slow start: a channel with no run time measured yet is charged the default estimate
    (10 ms), so a claim for eight free workers gave a new tenant of 3 s tasks most of them and
    every other tenant waited 3 s. Until its first settlement folds it gets one at a time."""
    f.enqueue("fast", 200)
    run({"fast": 0.02}, 3, limit=4)  # fast has a measured run time (20 ms)
    enqueue_many([EnqueueRequest(f.NOOP, channel=("acme", "slow") if grouped else "slow")] * 20)
    name = "acme/slow" if grouped else "slow"

    def claims(n: int) -> list[list[str]]:
        """``n`` claims of 8 for free workers; fast's messages run 20 ms and settle at once."""
        seen = []
        for _ in range(n):
            got = claim(8, quantum=8)
            assert len(got) == 8  # nobody waits for the slow tenant's first result
            done = [m for m in got if m.channel == "fast"]
            backdate([m.id for m in done], 0.02)
            message_store.complete_messages(
                [(m.id, m.lease_token, None) for m in done], run_seconds=[0.02] * len(done)
            )
            seen.append([m.channel for m in got])
            running.extend(m for m in got if m.channel == name)
        return seen

    running: list[message_store.ClaimedMessage] = []
    assert all(c.count(name) <= 1 for c in claims(6))
    assert len(running) == 1  # one message at a time, over six claims
    (started,) = running
    backdate([started.id], 3.0)  # it ran 3 s
    message_store.complete_messages([(started.id, started.lease_token, None)], run_seconds=[3.0])
    # its settlement woke the claim, which folded it first: charged 3 s a message from now on,
    # it waits while fast catches up
    assert all(name not in c for c in claims(3))
    assert len(running) == 1
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_batch_claims_share_time_before_the_maintenance_loop_ever_folds() -> None:
    """Claims of 4 (a worker claiming for its free threads) and no maintenance fold at all
    (it can be seconds late behind a million messages): the first settlements of each channel
    still fold at the next claim, so the shares follow run times, not the 10 ms default (with
    which a tenant of 200 ms tasks took 97 % of the worker time, as by count)."""
    f.enqueue_spread({"heavy": 200, "light": 2000})
    durations = {"heavy": 0.2, "light": 0.005}
    spent: Counter[str] = Counter()
    for _ in range(300):
        got = claim(4, quantum=4)
        assert got, "a claim came back empty while both channels had work"
        for m in got:
            backdate([m.id], durations[m.channel])
        message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got],
            run_seconds=[durations[m.channel] for m in got],
        )
        for m in got:
            spent[m.channel] += durations[m.channel]
    # within the bound: one claim's charge of each, plus the first claim's under-estimate
    assert abs(spent["heavy"] - spent["light"]) <= 2 * 4 * 0.2 + 1e-9, spent
    assert jain(list(spent.values())) > 0.95, spent


@pytest.mark.django_db(transaction=True)
def test_after_the_queue_went_idle_nobody_comes_back_ahead() -> None:
    """Both idle at once: the one that wakes first must not keep an old, low tag (the
    system's virtual time is then the largest tag, not the smallest)."""
    f.enqueue("alice", 1)
    run({"alice": 0.01}, 1)
    f.enqueue("bob", 100)
    run({"bob": 0.2}, 100)  # bob drains: nothing is claimable now
    f.enqueue("alice", 100)  # alice wakes first
    f.fold_all()
    f.enqueue("bob", 100)
    f.fold_all()
    _spent, counts = run({"alice": 0.2, "bob": 0.2}, 20)
    assert abs(counts["alice"] - counts["bob"]) <= 2, counts


@pytest.mark.django_db(transaction=True)
def test_a_resumed_channel_does_not_bring_the_time_it_was_paused() -> None:
    f.enqueue_spread({"alice": 200, "bob": 200})
    run({"alice": 0.1, "bob": 0.1}, 4)
    f.set_limits(["alice"], paused=True)
    run({"bob": 0.1}, 50)
    # what the admin's resume action does: unpause, then fold the channel (which lifts it)
    f.set_limits(["alice"], paused=False)
    channel_store.fold_deltas_of_channel(f.channel_ids(["alice"])["alice"])
    _spent, counts = run({"alice": 0.1, "bob": 0.1}, 20)
    assert abs(counts["alice"] - counts["bob"]) <= 2, counts


def hold_back(name: str, how: str) -> None:
    """Keep channel ``name`` from being served while the others run: paused, rate-limited
    (served once more, then not for an hour) or at its cap (one message of it left running)."""
    f.set_limits([name], **{how: HOLDS[how]})
    while how != "paused":
        (m,) = claim(1)
        if m.channel == name and how == "max_concurrency":
            return
        message_store.complete_messages([(m.id, m.lease_token, None)], run_seconds=[0.1])
        f.fold_all()
        if m.channel == name:
            return


#: How a channel is held back, and what releases it.
HOLDS: dict[str, Any] = {
    "paused": True,
    "release_interval": timedelta(hours=1),
    "max_concurrency": 1,
}


RELEASES: dict[str, Any] = {
    "paused": False,
    "release_interval": timedelta(0),
    "max_concurrency": None,
}


def release(name: str, how: str, path: str) -> None:
    """Release channel ``name`` held back by ``how``, written through ``path``: the admin's
    change page (the reference), or ``save()``, ``save(update_fields=...)``, ``update()`` or
    ``bulk_update()`` of the model."""
    value = RELEASES[how]
    if path == "update":
        f.set_limits([name], **{how: value})
        return
    channel = Channel.objects.get(name=name)
    setattr(channel, how, value)
    if path == "admin":

        class Form:
            changed_data = [how]

        admin.site._registry[Channel].save_model(RequestFactory().post("/"), channel, Form(), True)
    elif path == "save":
        channel.save()
    elif path == "save(update_fields)":
        channel.save(update_fields=[how])
    else:
        assert Channel.objects.bulk_update([channel], [how]) == 1


@pytest.mark.parametrize("how", list(RELEASES))
@pytest.mark.parametrize("path", ["admin", "save", "save(update_fields)", "update", "bulk_update"])
@pytest.mark.django_db(transaction=True)
def test_a_channel_released_through_the_model_is_lifted_as_the_admin_lifts_it(
    how: str, path: str
) -> None:
    """Resumed, its rate limit removed or its cap lifted, however the row is written, a channel
    comes back level with the others' tag, not with the credit of the time it was held back
    (which would give it every start until it caught up)."""
    f.enqueue_spread({"alice": 200, "bob": 200})
    run({"alice": 0.1, "bob": 0.1}, 4)
    hold_back("alice", how)
    run({"bob": 0.1}, 50)
    assert vtime("alice") < vtime("bob") - 4  # 5 s of bob's time while alice was held
    release("alice", how, path)
    # the admin's lift: to the virtual time of the others (bob's tag), at most one charge ahead
    assert vtime("bob") - 1e-9 <= vtime("alice") <= vtime("bob") + 0.1 + 1e-9
    _spent, counts = run({"alice": 0.1, "bob": 0.1}, 20)
    assert abs(counts["alice"] - counts["bob"]) <= 2, counts


@pytest.mark.django_db(transaction=True)
def test_by_count_a_write_of_the_limits_leaves_the_tags_and_the_deltas() -> None:
    """Count mode does not read the tags: a model write of the limits does not fold for them."""
    f.enqueue_spread({"alice": 10, "bob": 10})
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET vtime = 7 WHERE name = 'bob'")
    with override_settings(FAIRQUEUE={**_base(), "FAIRNESS": "count"}):
        f.set_limits(["alice"], paused=True)
        f.set_limits(["alice"], paused=False, weight=2)
        channel = Channel.objects.get(name="alice")
        channel.max_concurrency = 3
        channel.save()
    assert vtime("alice") == 0.0
    with connection.cursor() as cur:  # alice's enqueue still waits for a fold
        cur.execute(
            "SELECT count(*) FROM fairqueue_channel_delta WHERE channel_id = %s",
            [f.channel_ids(["alice"])["alice"]],
        )
        (pending,) = cur.fetchone()
    assert pending > 0


# ------------------------------------------------------------------------------------------------
# Groups: a group's tag is corrected by its channels' real run time, as a channel's is


def group_vtime(name: str) -> float:
    with connection.cursor() as cur:
        cur.execute("SELECT vtime FROM fairqueue_channel_group WHERE name = %s", [name])
        (value,) = cur.fetchone()
    return float(value)


@pytest.mark.django_db(transaction=True)
def test_a_group_of_fresh_sub_channels_gets_half_the_worker_time_not_most_of_it() -> None:
    """One tenant's 400 messages each in a fresh channel of its group (one per user or
    document, as the groups how-to suggests), another's 400 in one channel of its group; equal
    weights, equal durations. Each fresh channel is charged the default estimate (10 ms) at
    its claim; the group must then be charged what really ran (100 ms), or the tenant of fresh
    channels takes most of the worker time."""
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=("many", f"u{i:03d}")) for i in range(400))
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=("one", "only")) for i in range(400))
    durations = {f"many/u{i:03d}": 0.1 for i in range(400)} | {"one/only": 0.1}
    spent, _counts = run(durations, 200)
    many = sum(t for name, t in spent.items() if name.startswith("many/"))
    share = many / (many + spent["one/only"])
    assert 0.45 <= share <= 0.55, (many, spent["one/only"])


@pytest.mark.django_db(transaction=True)
def test_a_rescued_message_charges_its_group_the_time_since_its_claim() -> None:
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=("acme", "heavy")) for i in range(20))
    run({"acme/heavy": 0.2}, 5)
    before = group_vtime("acme")
    (m,) = claim(1)
    with connection.cursor() as cur:  # claimed 2 s ago, its worker died
        cur.execute(
            "UPDATE fairqueue_message SET claimed_at = claimed_at - interval '2 seconds', "
            "lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = %s",
            [m.id],
        )
    (rescued,) = message_store.rescue_expired_messages()
    assert rescued.id == m.id
    f.fold_all()
    assert group_vtime("acme") == pytest.approx(before + 2.0, abs=0.05)


@pytest.mark.django_db(transaction=True)
def test_the_counter_repair_keeps_the_run_times_of_the_deltas_it_deletes() -> None:
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=("acme", "heavy")) for i in range(20))
    run({"acme/heavy": 0.2}, 5)
    channel, group = vtime("acme/heavy"), group_vtime("acme")
    (m,) = claim(1)  # charged the mean, 0.2 s, in advance
    backdate([m.id], 0.5)
    message_store.complete_messages([(m.id, m.lease_token, None)], run_seconds=[0.5])
    assert (
        integrity_store.repair_channel_counters(list(f.channel_ids(["acme/heavy"]).values())) == []
    )
    f.fold_all()
    # corrected to what ran, 0.5 s, as the fold of the deleted delta would have
    assert vtime("acme/heavy") == pytest.approx(channel + 0.5, abs=0.03)
    assert group_vtime("acme") == pytest.approx(group + 0.5, abs=0.03)


# ------------------------------------------------------------------------------------------------
# What settlements charge


def delta_runs(name: str) -> tuple[float, int]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT coalesce(sum(run_seconds), 0), coalesce(sum(run_count), 0) "
            "FROM fairqueue_channel_delta d JOIN fairqueue_channel c ON c.id = d.channel_id "
            "WHERE c.name = %s",
            [name],
        )
        run_seconds, run_count = cur.fetchone()
    return float(run_seconds), int(run_count)


@pytest.mark.django_db(transaction=True)
def test_a_failure_charges_its_reported_time_but_never_more_than_the_database_saw() -> None:
    f.enqueue("a", 2)
    f.fold_all()
    f.measured()
    first, second = claim(2, quantum=2)
    backdate([first.id, second.id], 2.0)
    # a timed-out attempt reports its time limit (1.5 s); a worker whose clock jumped reports
    # an hour, but only about 2 s passed on the database's clock since the claim
    message_store.fail_messages(
        [
            (first.id, first.lease_token, {"type": "TaskTimeout"}, None),
            (second.id, second.lease_token, {"type": "X"}, None),
        ],
        run_seconds=[1.5, 3600.0],
    )
    run_seconds, run_count = delta_runs("a")
    assert run_count == 2
    assert 1.5 + 2.0 <= run_seconds < 1.5 + 2.5


@pytest.mark.django_db(transaction=True)
def test_an_unreported_run_time_is_the_time_since_the_claim_and_never_negative() -> None:
    f.enqueue("a", 2)
    f.fold_all()
    f.measured()
    first, second = claim(2, quantum=2)
    backdate([first.id], 0.3)
    backdate([second.id], -60)  # the database's clock stepped back since the claim
    message_store.complete_messages([(m.id, m.lease_token, None) for m in (first, second)])
    run_seconds, run_count = delta_runs("a")
    assert run_count == 2
    assert 0.3 <= run_seconds < 0.8


@pytest.mark.django_db(transaction=True)
def test_a_rescued_message_is_charged_at_most_one_lease() -> None:
    f.enqueue("a", 1)
    f.fold_all()
    (m,) = claim(1)
    with connection.cursor() as cur:  # claimed an hour ago, its worker died
        cur.execute(
            "UPDATE fairqueue_message SET claimed_at = claimed_at - interval '1 hour', "
            "lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = %s",
            [m.id],
        )
    with override_settings(FAIRQUEUE={**_base(), **TIME, "LEASE_SECONDS": 30.0}):
        (rescued,) = message_store.rescue_expired_messages()
    assert rescued.id == m.id
    assert delta_runs("a") == (30.0, 1)


# ------------------------------------------------------------------------------------------------
# Concurrent claimers: the invariants hold by time as by count


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_by_time_never_exceed_caps_nor_claim_twice() -> None:
    names = [f"t{i}" for i in range(8)]
    f.enqueue_spread({name: 60 for name in names})
    f.set_limits(names[:4], max_concurrency=2)
    f.fold_all()
    cap_ids = set(f.channel_ids(names[:4]).values())
    claimed: list[int] = []
    running: defaultdict[int, int] = defaultdict(int)
    worst: defaultdict[int, int] = defaultdict(int)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer(i: int) -> None:
        try:
            with connection.cursor() as cur:
                cur.execute("SET synchronous_commit = off")
            empty = 0
            while empty < 20:
                got = message_store.claim_messages(3, lease=LEASE, worker_id=f"w{i}")
                if not got:
                    empty += 1
                    channel_store.fold_channel_deltas()
                    continue
                empty = 0
                with lock:
                    for m in got:
                        claimed.append(m.id)
                        running[m.channel_id] += 1
                        worst[m.channel_id] = max(worst[m.channel_id], running[m.channel_id])
                time.sleep(0.002)  # "running"
                with lock:
                    for m in got:
                        running[m.channel_id] -= 1
                message_store.complete_messages(
                    [(m.id, m.lease_token, None) for m in got],
                    run_seconds=[0.001 * (1 + m.channel_id % 5) for m in got],
                )
                if i == 0:
                    channel_store.fold_channel_deltas()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(claimed) == len(set(claimed)) == 8 * 60, "a message was claimed twice or lost"
    for cid in cap_ids:
        assert worst[cid] <= 2, f"channel {cid} ran {worst[cid]} at once, cap 2"
    f.assert_counters_match_table()


@pytest.mark.parametrize("held_for", [0.1, 1.0])
@pytest.mark.parametrize("limit", [1, 5])
@pytest.mark.django_db(transaction=True)
def test_a_claim_waits_for_the_smallest_tag_held_by_another_claim(
    held_for: float, limit: int
) -> None:
    """The channel of smallest tag is held (as by a concurrent claim): a claim that locked a
    channel far ahead in tag order waits for it, up to CLAIM_WAIT, and serves only it, rather
    than give the slot to the channel of long tasks (also when the claim had room for more:
    the channel it passed over gave way to the smaller tag, and is not topped up); held longer
    than that, the claim comes back empty (its lock wait timed out) and leaves both channels
    as they were."""
    f.enqueue_spread({"heavy": 20, "light": 1})
    f.measured()
    f.fold_all()
    ids = f.channel_ids(["heavy", "light"])
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET vtime = 1.0 WHERE id = %s", [ids["heavy"]])
    holding, released = threading.Event(), threading.Event()

    def holder() -> tuple[list[str], float]:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT 1 FROM fairqueue_channel WHERE id = %s FOR UPDATE", [ids["light"]])
            holding.set()
            released.wait(held_for)
        return [], 0.0

    def claimer() -> tuple[list[str], float]:
        assert holding.wait(10)
        started = time.monotonic()
        try:
            got = [m.channel for m in claim(limit)]
        finally:
            released.set()
        return got, time.monotonic() - started

    with override_settings(FAIRQUEUE={**_base(), **TIME, "CLAIM_WAIT": 0.5}):
        _, (got, waited) = run_threads(2, lambda i: (holder, claimer)[i]())
    if held_for < 0.5:  # released within CLAIM_WAIT: the claim waited for it
        assert got == ["light"]
        assert waited >= 0.08
    else:  # held past CLAIM_WAIT: nothing, and the next claim finds both as they were
        assert got == []
        assert 0.4 <= waited < 1.0
        assert [m.channel for m in claim(1)] == ["light"]


@pytest.mark.django_db(transaction=True)
def test_why_waiting_counts_the_channels_of_smaller_tags_ahead() -> None:
    f.enqueue_spread({"heavy": 50, "light": 50, "idle": 1})
    run({"heavy": 0.2, "light": 0.005, "idle": 0.001}, 12)
    ids = f.channel_ids(["heavy", "light"])
    heavy = channel_store.select_channel_wait_state(ids["heavy"])
    light = channel_store.select_channel_wait_state(ids["light"])
    assert heavy is not None and light is not None
    # by time the order is the tags': whichever was charged less is ahead of the other
    smaller = "heavy" if vtime("heavy") < vtime("light") else "light"
    assert {"heavy": heavy.ahead, "light": light.ahead}[smaller] == 0
    assert {"heavy": heavy.ahead, "light": light.ahead}[
        "light" if smaller == "heavy" else "heavy"
    ] == 1


@pytest.mark.django_db(transaction=True)
def test_a_claim_of_several_goes_by_tags_not_one_turn_each() -> None:
    """By count a claim of 4 with turns of 1 gives each channel its turn; by time it gives
    every message to the channel whose next one would start first, so a channel far ahead in
    tag order gets none, however many slots the claim fills."""
    f.enqueue_spread({"heavy": 50, "light": 200})
    run({"heavy": 0.2, "light": 0.005}, 20)
    assert vtime("light") + 4 * 0.005 < vtime("heavy")
    got = claim(4, quantum=1)
    assert [m.channel for m in got] == ["light"] * 4


def reference_allocation(channels: list[dict[str, Any]], limit: int) -> Counter:
    """What a claim of ``limit`` by time gives each channel (quantum 1, no group): the walk
    locks channels in tag order until their turns (``weight`` messages each, at most the
    room) cover ``limit``, then every message goes to the locked channel whose next message
    starts at the smallest tag, each up to its room."""
    walked, covered = [], 0
    for ch in sorted(channels, key=lambda c: (c["vtime"], c["id"])):
        walked.append(ch)
        covered += min(ch["weight"], ch["room"])
        if covered >= limit:
            break
    starts = sorted(
        (ch["vtime"] + i * (ch["mean_run"] / ch["weight"]), k)
        for k, ch in enumerate(walked)
        for i in range(min(ch["room"], limit))
    )
    return Counter(walked[k]["name"] for _, k in starts[:limit])


@pytest.mark.django_db(transaction=True)
def test_a_claim_of_several_gives_what_the_merge_of_start_tags_gives() -> None:
    """Random tags, run times, weights, caps and backlogs: a claim of several by time gives
    each channel exactly what the merge of the locked channels' start tags gives (the claim
    reads only the head of each sequence, bounded by what the claim can take)."""
    rnd = random.Random(20261201)
    for trial in range(25):
        limit = rnd.choice([2, 5, 8, 13])
        names = [f"t{trial}-c{i:02d}" for i in range(rnd.randint(limit, limit + 6))]
        backlog = {name: rnd.randint(1, 25) for name in names}
        f.enqueue_spread(backlog)
        f.fold_all()
        ids = f.channel_ids(names)
        channels = []
        for name in names:
            cap = rnd.choice([None, 1, 2, 3, 10])
            ch = {
                "name": name,
                "id": ids[name],
                "vtime": round(rnd.uniform(0, 0.05), 6),
                "mean_run": rnd.choice([0.001, 0.01, 0.01, rnd.uniform(0.0005, 0.05)]),
                "weight": rnd.choice([1, 1, 2, 3]),
                "room": min(backlog[name], cap or backlog[name]),
            }
            channels.append(ch)
            Channel.objects.filter(id=ch["id"]).update(weight=ch["weight"], max_concurrency=cap)
            with connection.cursor() as cur:
                cur.execute(
                    "UPDATE fairqueue_channel SET vtime = %s, mean_run = %s WHERE id = %s",
                    [ch["vtime"], ch["mean_run"], ch["id"]],
                )
        got = claim(limit, quantum=1)
        assert Counter(m.channel for m in got) == reference_allocation(channels, limit), trial
        message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
        Channel.objects.filter(name__in=names).update(paused=True)


@pytest.mark.django_db(transaction=True)
def test_a_claim_of_several_gives_a_whole_batch_when_charges_are_below_the_tags_precision() -> None:
    """Weights of 1,000 and a mean run of 1 µs charge 1e-9 a message, below the rounding step
    of a tag of 1e8: every start tag of a channel rounds to its tag, and the merge takes the
    batch in channel order, all of it."""
    f.enqueue_spread({"a": 3, "b": 20})
    f.fold_all()
    assert Channel.objects.filter(name__in=["a", "b"]).update(weight=1000) == 2
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET vtime = 1e8, mean_run = 1e-6")
    got = claim(10)
    assert Counter(m.channel for m in got) == {"a": 3, "b": 7}


@pytest.mark.django_db(transaction=True)
def test_by_time_several_queues_still_take_turns_whatever_a_claim_gives_a_channel() -> None:
    """The queues are served in the order of their channels' turns, which a claim moves only
    once a channel has used up its turn (here two claims of one each, at weight 2): each
    queue's turn comes."""
    f.enqueue_in_queue("qa", "acme", 30)
    f.enqueue_in_queue("qb", "bob", 30)
    f.measured()
    f.fold_all()
    assert Channel.objects.filter(queue="qa").update(weight=2) == 1
    order = []
    for _ in range(12):
        got = claim(1, queues=["qa", "qb"])
        assert len(got) == 1
        order.append(got[0].queue)
        message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got], run_seconds=[0.01]
        )
        f.fold_all()
    assert Counter(order)["qb"] >= 3, order


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("grouped", [False, True])
def test_slow_start_never_idles_a_worker(grouped: bool) -> None:
    """Slow start orders, it does not hold free workers idle: with nobody else waiting, a new
    tenant's claim of 8 gets 8, not 1, and a claim while those run gets more, up to the
    channel's cap (and a group's channel up to its group's)."""
    channel = ("acme", "new") if grouped else "new"
    name = "acme/new" if grouped else "new"
    enqueue_many([EnqueueRequest(f.NOOP, (i,), channel=channel) for i in range(30)])
    first = claim(8)
    assert [m.channel for m in first] == [name] * 8  # was 1: slow start held it to one
    assert len({m.lease_token for m in first}) == 1  # the top-up is part of the claim
    assert len(claim(8)) == 8  # its first messages still run: it was passed over, got 0
    holder = ChannelGroup if grouped else Channel
    assert holder.objects.filter(name="acme" if grouped else "new").update(max_concurrency=20)
    assert len(claim(8)) == 4  # the cap holds in the top-up
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("queues", [None, ["qa", "qb"]])
def test_slow_start_tops_up_only_after_every_known_channel_of_every_queue(
    queues: list[str] | None,
) -> None:
    """A claim serves the channels whose run time is known first, in every queue it claims,
    and gives only the rest to a new tenant: one message from slow start, the others from the
    top-up. A tenant with work in two queues: the claim's queue order does not let the new
    tenant's queue take the known tenant's messages."""
    f.enqueue_in_queue("qa", "new", 30)  # first: its queue is served first
    f.enqueue_in_queue("qb", "known", 3)
    with connection.cursor() as cur:  # known has run before
        cur.execute("UPDATE fairqueue_channel SET mean_run = 0.01 WHERE queue = 'qb'")
    f.fold_all()
    got = claim(8, queues=queues)
    assert Counter(m.channel for m in got) == {"known": 3, "new": 5}
    assert len({m.lease_token for m in got}) == 1  # one token, its queues' and its top-up's
    later = claim(8, queues=queues)  # known has nothing left: new gets the claim
    assert Counter(m.channel for m in later) == {"new": 8}


@pytest.mark.django_db(transaction=True)
def test_a_rate_limit_holds_in_the_top_up() -> None:
    """The top-up is the claim with slow start off, not without limits: a new, rate-limited
    channel still gets one message an interval."""
    f.enqueue("new", 10)
    f.set_limits(["new"], release_interval=timedelta(hours=1))
    assert len(claim(8)) == 1
    assert claim(8) == []


def claim_calls(limit: int, queues: list[str] | None) -> tuple[int, int]:
    """What one claim (as the worker makes it, rolled back) returns, and how many calls of the
    claim function it ran, its own parts and its top-up included."""
    calls = (
        "SELECT coalesce(sum(pg_stat_get_xact_function_calls(p.oid)), 0) FROM pg_proc p "
        "WHERE p.proname = 'fairqueue_claim_v1'"
    )
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL track_functions = 'pl'")
        cur.execute(calls)  # (what earlier transactions counted may not be flushed yet)
        (before,) = cur.fetchone()
        cur.execute(
            "SELECT count(*) FROM fairqueue_claim_v1(%s, interval '5 min', 'test-worker', NULL, "
            "NULL, NULL, true, 50, true, %s::text[])",
            [limit, queues],
        )
        (rows,) = cur.fetchone()
        cur.execute(calls)
        (after,) = cur.fetchone()
        transaction.set_rollback(True)
    return rows, int(after - before)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("queues", [None, ["default"], ["qa", "qb"]])
def test_a_claim_with_no_slow_starting_channel_is_not_topped_up(queues: list[str] | None) -> None:
    """The top-up runs only when slow start held a channel back: an idle poll of any queues,
    and a short claim where no channel is new, are one call of the claim, not two."""
    assert claim_calls(10, queues) == (0, 1)
    f.enqueue_spread({f"k{i}": 2 for i in range(5)})
    f.measured()
    f.fold_all()
    assert claim_calls(100, None) == (10, 1)
    f.enqueue("new", 5)
    f.fold_all()
    assert claim_calls(100, None) == (15, 2)  # (it holds new to one, and tops up)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["several queues", "CLAIM_WAIT 0", "CLAIM_WAIT"])
def test_a_known_channel_held_by_a_concurrent_claim_keeps_its_slot(how: str) -> None:
    """A known tenant with work, its channel held for a moment by a concurrent claim; a new
    tenant running its first message. A claim that finds the known channel held comes back
    short, but that is lock traffic, not an idle worker: it is not topped up with the new
    tenant (which would give it one more worker per collision)."""
    f.enqueue("known", 20)
    f.enqueue_in_queue("qa", "other", 20)
    f.measured()
    f.enqueue("new", 20)
    f.fold_all()
    new = f.channel_ids(["new"])["new"]
    known = list(Channel.objects.exclude(id=new).values_list("id", flat=True))  # and other
    claim(1, only_channel_ids=[new])  # new's first message runs
    holding, released = threading.Event(), threading.Event()

    def holder() -> list[str]:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT 1 FROM fairqueue_channel WHERE id = ANY (%s) FOR UPDATE", [known])
            holding.set()
            released.wait(0.3)
        return []

    def claimer() -> list[str]:
        assert holding.wait(10)
        try:
            queues = ["default", "qa"] if how == "several queues" else ["default"]
            return [m.channel for m in claim(1, queues=queues)]
        finally:
            released.set()

    wait = 0.0 if how == "CLAIM_WAIT 0" else 0.05
    with override_settings(FAIRQUEUE={**_base(), **TIME, "CLAIM_WAIT": wait}):
        _, got = run_threads(2, lambda i: (holder, claimer)[i]())
    assert "new" not in got


@pytest.mark.django_db(transaction=True)
def test_the_top_up_keeps_the_claims_filters_and_a_callers_transaction() -> None:
    """only/exclude hold in the top-up; inside a caller's transaction (exactly-once) it neither
    waits nor leaves lock_timeout changed."""
    f.enqueue("known", 1)
    f.measured()
    f.enqueue("new", 10)
    f.fold_all()
    ids = f.channel_ids(["known", "new"])
    assert [m.channel for m in claim(8, only_channel_ids=[ids["known"]])] == ["known"]
    assert claim(8, exclude_channel_ids=[ids["new"]]) == []
    with transaction.atomic():
        got = claim(5, exclude_channel_ids=[ids["known"]], maintain=False)
        assert [m.channel for m in got] == ["new"] * 5
        with connection.cursor() as cur:
            cur.execute("SHOW lock_timeout")
            assert cur.fetchone() == ("0",)
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_a_claim_whose_waited_channel_left_serves_its_walk_and_is_topped_up() -> None:
    """The claim waits for the smallest tag (held), which is no longer claimable once its
    holder commits: the channels the walk locked did not give way to anything, so they are
    served, and a slow-starting channel gets the rest."""
    f.enqueue_spread({"heavy": 2, "light": 1})
    f.measured()
    f.enqueue("new", 10)
    f.fold_all()
    ids = f.channel_ids(["heavy", "light", "new"])
    claim(1, only_channel_ids=[ids["new"]])  # new's first message runs
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET vtime = 1.0 WHERE id = %s", [ids["heavy"]])
        cur.execute("UPDATE fairqueue_channel SET vtime = 5.0 WHERE id = %s", [ids["new"]])
    holding, released = threading.Event(), threading.Event()

    def holder() -> list[str]:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT 1 FROM fairqueue_channel WHERE id = %s FOR UPDATE", [ids["light"]])
            holding.set()
            released.wait(0.2)
            cur.execute("UPDATE fairqueue_channel SET paused = true WHERE id = %s", [ids["light"]])
        return []

    def claimer() -> list[str]:
        assert holding.wait(10)
        try:
            return [m.channel for m in claim(6)]
        finally:
            released.set()

    with override_settings(FAIRQUEUE={**_base(), **TIME, "CLAIM_WAIT": 0.5}):
        _, got = run_threads(2, lambda i: (holder, claimer)[i]())
    assert Counter(got) == {"heavy": 2, "new": 4}


@pytest.mark.django_db(transaction=True)
def test_a_claim_holding_channel_names_does_not_wait_in_its_top_up() -> None:
    """A claim takes channel names (step 3b, held to its commit) only after its last wait for
    a held channel. A first pass that locked and counted x (its name held) but got nothing
    (x's ready rows locked by another transaction) is topped up without waiting for the new
    channel a concurrent claim holds: an enqueue to x does not wait behind it."""
    f.enqueue("x", 2)
    f.measured()
    f.enqueue("y", 5)
    f.fold_all()
    ids = f.channel_ids(["x", "y"])
    claim(1, only_channel_ids=[ids["y"]])  # y's first message runs
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET vtime = 1.0 WHERE id = %s", [ids["x"]])
        cur.execute("UPDATE fairqueue_channel SET vtime = 0.0 WHERE id = %s", [ids["y"]])
    ready = threading.Barrier(3)
    took: dict[str, float] = {}

    def rows_holder() -> None:  # an operator's action on x's messages, say
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(
                "SELECT 1 FROM fairqueue_message WHERE channel_id = %s FOR UPDATE", [ids["x"]]
            )
            ready.wait()
            time.sleep(1.5)

    def channel_holder() -> None:  # a concurrent claim holding y
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT 1 FROM fairqueue_channel WHERE id = %s FOR UPDATE", [ids["y"]])
            ready.wait()
            time.sleep(1.2)

    def claimer() -> None:
        ready.wait()
        claim(5, queues=["default"])

    def enqueuer() -> None:
        time.sleep(0.25)  # the claim has locked x by now
        started = time.monotonic()
        f.enqueue("x", 1)
        took["enqueue"] = time.monotonic() - started

    with override_settings(FAIRQUEUE={**_base(), **TIME, "CLAIM_WAIT": 0.8}):
        run_threads(4, lambda i: (rows_holder, channel_holder, claimer, enqueuer)[i]())
    assert took["enqueue"] < 0.4, took  # (it waited for the claim's wait: 0.6 s and more)


@pytest.mark.django_db(transaction=True)
def test_levelling_the_tags_after_a_period_by_count_starts_every_channel_even() -> None:
    """Claims by count neither charge nor lift tags: a channel created while the fleet counted
    starts at 0, far behind channels the fleet served by time before, and by time again would
    take every claim until it caught up. `fairqueue level` starts every channel and group
    even."""
    f.enqueue_spread({"a": 30, "b": 30})
    ChannelGroup.objects.create(name="acme")
    enqueue_many([EnqueueRequest(f.NOOP, (i,), channel=("acme", "u")) for i in range(30)])
    f.fold_all()
    with connection.cursor() as cur:  # as after a long time by time
        cur.execute("UPDATE fairqueue_channel SET vtime = 110")
        cur.execute("UPDATE fairqueue_channel_group SET vtime = 110")
    with override_settings(FAIRQUEUE={**_base(), "FAIRNESS": "count"}):
        f.enqueue("late", 30)  # created, and its messages counted, while counting: tag 0
        f.fold_all()
    f.measured()
    assert {m.channel for m in claim(8)} == {"late"}  # far behind: it takes the claim
    out = StringIO()
    call_command("fairqueue", "level", stdout=out)
    assert out.getvalue().strip() == "levelled the tags of 4 channel(s) and 1 channel group(s)"
    got = Counter(m.channel for m in claim(12))
    assert got == {"a": 3, "b": 3, "acme/u": 3, "late": 3}, got


@pytest.mark.django_db(transaction=True)
def test_a_claim_spreads_over_the_channels_its_turns_cover_whatever_earlier_claims_left() -> None:
    """By time a turn only sizes the walk: a claim of 8 with turns of 4 locks two channels
    and shares its messages between them, though earlier claims left each channel's turn
    nearly used (by count that would make a turn of one, and eight channels)."""
    names = [f"t{i}" for i in range(10)]
    f.enqueue_spread({name: 20 for name in names})
    f.measured()
    f.fold_all()
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET turn_used = 3")
    got = claim(8, quantum=4)
    assert len(got) == 8
    assert len({m.channel for m in got}) <= 2


# ------------------------------------------------------------------------------------------------
# A group whose limits are eased is lifted as a channel is


#: How group g1 is held back (a group has no pause), and what releases it.
GROUP_HOLDS: dict[str, Any] = {"release_interval": timedelta(hours=1), "max_concurrency": 1}
GROUP_RELEASES: dict[str, Any] = {"release_interval": timedelta(0), "max_concurrency": None}


def release_group(how: str, path: str) -> None:
    """Release group g1 held back by ``how``, written through ``path``: the admin's change
    page, or ``save()``, ``update()`` or ``bulk_update()`` of the model."""
    value = GROUP_RELEASES[how]
    if path == "update":
        assert ChannelGroup.objects.filter(name="g1").update(**{how: value}) == 1
        return
    group = ChannelGroup.objects.get(name="g1")
    setattr(group, how, value)
    if path == "admin":

        class Form:
            changed_data = [how]

        group_admin = admin.site._registry[ChannelGroup]
        group_admin.save_model(RequestFactory().post("/"), group, Form(), True)
    elif path == "save":
        group.save()
    else:
        assert ChannelGroup.objects.bulk_update([group], [how]) == 1


@pytest.mark.parametrize("how", list(GROUP_RELEASES))
@pytest.mark.parametrize("path", ["admin", "save", "update", "bulk_update"])
@pytest.mark.django_db(transaction=True)
def test_a_group_released_through_the_model_is_lifted_as_a_channel_is(how: str, path: str) -> None:
    """Its rate limit removed or its cap raised, however the row is written, a group comes back
    level with the other's tag, not with the credit of the time it was held back (which gave
    it every start until it caught up)."""
    ChannelGroup.objects.create(name="g1")
    ChannelGroup.objects.create(name="g2")
    f.enqueue_spread({"g1/a": 200, "g2/a": 200})
    durations = {"g1/a": 0.1, "g2/a": 0.1}
    run(durations, 4)  # both measured
    ChannelGroup.objects.filter(name="g1").update(**{how: GROUP_HOLDS[how]})
    (m,) = claim(1, only_channel_ids=list(f.channel_ids(["g1/a"]).values()))
    if how == "release_interval":  # served once more, then not for an hour
        message_store.complete_messages([(m.id, m.lease_token, None)], run_seconds=[0.1])
        f.fold_all()
    # (else its one message stays running: g1 is at its cap)
    run({"g2/a": 0.1}, 50)
    assert group_vtime("g1") < group_vtime("g2") - 4  # 5 s of g2's time while g1 was held
    release_group(how, path)
    assert group_vtime("g2") - 1e-9 <= group_vtime("g1") <= group_vtime("g2") + 0.1 + 1e-9
    _spent, counts = run(durations, 20)
    assert abs(counts["g1/a"] - counts["g2/a"]) <= 2, counts


@pytest.mark.django_db(transaction=True)
def test_by_count_a_write_of_a_groups_limits_leaves_the_tags() -> None:
    """Count mode does not read the tags: a model write of a group's limits does not lift it."""
    ChannelGroup.objects.create(name="g1", max_concurrency=1)
    ChannelGroup.objects.create(name="g2")
    f.enqueue_spread({"g1/a": 10, "g2/a": 10})
    f.fold_all()
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel_group SET vtime = 7 WHERE name = 'g2'")
    with override_settings(FAIRQUEUE={**_base(), "FAIRNESS": "count"}):
        ChannelGroup.objects.filter(name="g1").update(max_concurrency=5)
        group = ChannelGroup.objects.get(name="g1")
        group.weight = 2
        group.save()
    assert group_vtime("g1") == 0.0
