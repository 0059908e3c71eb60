"""The schedules' admin: next fire time, checked forms, code schedules read-only but for their
pause, stale forms that cannot move the firing state, and permissions."""

from __future__ import annotations

import re
from html import escape
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_fairqueue import schedules
from django_fairqueue.cron import ScheduleSpec
from django_fairqueue.models import Channel, Message, Schedule

from .test_admin import action, client_for, user_with
from .test_schedules import TASK, report

pytestmark = pytest.mark.django_db

LIST = "admin:fairqueue_schedule_changelist"
ADD = "admin:fairqueue_schedule_add"


def change_url(schedule: Schedule) -> str:
    return reverse("admin:fairqueue_schedule_change", args=[schedule.pk])


def form(channel: Channel, **over: Any) -> dict[str, str]:
    data = {
        "name": "weekly report",
        "channel": str(channel.pk),
        "task_name": TASK,
        "args": "[1]",
        "kwargs": '{"kind": "weekly"}',
        "cron": "0 8 * * MON",
        "timezone": "Europe/Berlin",
        "missed": "latest",
        "catch_up_max": "10",
        "jitter": "0",
        "priority": "",
        "enabled": "on",
    }
    data.update({k: str(v) for k, v in over.items()})
    return data


def error_text(response: Any) -> str:
    return " ".join(
        str(e) for errors in response.context["adminform"].form.errors.values() for e in errors
    )


@pytest.fixture
def acme() -> Channel:
    return Channel.objects.create(name="acme")


def test_an_operator_adds_a_tenants_schedule_in_its_timezone(
    admin_client: Client, acme: Channel
) -> None:
    response = admin_client.post(reverse(ADD), form(acme))
    assert response.status_code == 302, error_text(response)
    schedule = Schedule.objects.get()
    assert (schedule.source, schedule.channel, schedule.args, schedule.kwargs) == (
        "admin",
        acme,
        [1],
        {"kind": "weekly"},
    )
    page = admin_client.get(reverse(LIST)).content.decode()
    assert "weekly report" in page
    assert " CET (in " in page or " CEST (in " in page  # the next fire, in Berlin time
    assert "next fire" in page.lower()
    # the channel's page lists it, linked to its form
    channel_page = admin_client.get(reverse("admin:fairqueue_channel_change", args=[acme.pk]))
    assert change_url(schedule) in channel_page.content.decode()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cron", "0 8 * *", "Wrong number of fields"),
        ("cron", "* * * * * *", "a field of seconds is not supported"),
        ("cron", "0 25 * * *", "Bad hour"),
        ("timezone", "Europe/Nowhere", "not a known timezone"),
        ("task_name", "no.such.task", "is not a registered task"),
        ("args", '{"a": 1}', "args must be a JSON list"),
        ("args", "[1,", "Enter a valid JSON"),
        ("kwargs", "[1]", "kwargs must be a JSON object"),
        ("jitter", "2 00:00:00", "jitter must be"),
        ("catch_up_max", "5000", "catch_up_max"),
        ("priority", "500", "priority must be between -100 and 100, got 500"),
        ("priority", "-101", "priority must be between -100 and 100, got -101"),
        ("args", "[" * 2000 + "]" * 2000, "nested too deeply"),
        ("kwargs", '{"a":' * 2000 + "1" + "}" * 2000, "nested too deeply"),
    ],
)
def test_a_bad_schedule_gets_a_clear_error_and_nothing_is_saved(
    admin_client: Client, acme: Channel, field: str, value: str, message: str
) -> None:
    response = admin_client.post(reverse(ADD), form(acme, **{field: value}))
    assert response.status_code == 200
    assert message in error_text(response)
    assert not Schedule.objects.exists()


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        ("[]", '{"bogus": 1}', "kwargs"),
        ('["acme", 2]', "{}", "args"),
        ("{}", '{"tenant": "acme"}', "args"),  # not a list: args's own error
    ],
)
def test_arguments_that_do_not_fit_are_refused_under_the_field_given(
    admin_client: Client, acme: Channel, args: str, kwargs: str, field: str
) -> None:
    data = form(acme, task_name=report.name, args=args, kwargs=kwargs)
    response = admin_client.post(reverse(ADD), data)
    errors = response.context["adminform"].form.errors
    assert list(errors) == [field], errors
    assert errors[field][0].startswith(
        ("arguments do not fit tests.schedules.report(tenant:", "args must be a JSON list")
    )


@pytest.mark.parametrize(
    ("typed", "field"),
    [
        ({"kwargs": '{"tenant": "\\ud800"}'}, "kwargs"),
        ({"args": '["\\udfff"]', "kwargs": "{}"}, "args"),
    ],
)
def test_arguments_with_a_lone_surrogate_come_back_as_typed_with_the_error(
    admin_client: Client, acme: Channel, typed: dict[str, str], field: str
) -> None:
    # JSON decodes the escape to a lone surrogate, which the page could not encode as UTF-8
    bad = {**form(acme, task_name=report.name, args="[]", kwargs='{"tenant": "acme"}'), **typed}
    schedule = Schedule.objects.create(
        name="s", channel=acme, task_name=report.name, kwargs={"tenant": "acme"}, cron="@daily"
    )
    for url in (reverse(ADD), change_url(schedule)):
        response = admin_client.post(url, bad)
        assert response.status_code == 200
        (why,) = response.context["adminform"].form.errors[field]  # the field typed in
        assert "are not valid Unicode" in why
        shown = response.context["adminform"].form[field].value()
        assert shown == typed[field] and escape(shown) in response.content.decode()
    schedule.refresh_from_db()
    assert (Schedule.objects.count(), schedule.kwargs) == (1, {"tenant": "acme"})


def test_arguments_that_do_not_fit_the_task_are_refused_by_the_form(
    admin_client: Client, acme: Channel
) -> None:
    bad = form(acme, task_name=report.name, args="[1, 2]")
    response = admin_client.post(reverse(ADD), bad)
    assert response.status_code == 200
    assert "arguments do not fit tests.schedules.report(tenant" in error_text(response)
    assert not Schedule.objects.exists()
    good = form(acme, task_name=report.name, args="[]", kwargs='{"tenant": "acme"}')
    assert admin_client.post(reverse(ADD), good).status_code == 302


def channel_select(page: Any) -> str:
    found = re.search(r'<select name="channel".*?</select>', page.content.decode(), re.S)
    assert found is not None
    return found.group(0)


@pytest.mark.parametrize("channel", ["abc", "\x00", "1.5", "99999999999999999999", "-1"])
def test_a_channel_that_is_no_id_leaves_the_form_without_one(
    admin_client: Client, acme: Channel, channel: str
) -> None:
    page = admin_client.get(reverse(ADD), {"channel": channel})
    assert page.status_code == 200
    assert "<option" not in channel_select(page)
    response = admin_client.post(reverse(ADD), {**form(acme), "channel": channel})
    assert response.status_code == 200
    (why,) = response.context["adminform"].form.errors["channel"]  # the field's own error
    assert why.startswith("Null characters" if channel == "\x00" else "Select a valid choice.")
    assert "<option" not in channel_select(response)
    assert not Schedule.objects.exists()
    # an id is filled in, as the channel page's link does
    page = admin_client.get(reverse(ADD), {"channel": acme.pk})
    assert f'<option value="{acme.pk}" selected>acme</option>' in channel_select(page)


def fired_once(schedule: Schedule) -> None:
    """Fire the schedule's current slot (its first pass, then its slot backdated to now)."""
    schedules.fire_due()
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_schedule SET next_fire_at = date_trunc('minute', now()) "
            "WHERE id = %s",
            [schedule.pk],
        )
    assert schedules.fire_due() == 1


def test_saving_a_form_opened_before_the_last_firing_keeps_the_firing_state(
    admin_client: Client, acme: Channel
) -> None:
    admin_client.post(reverse(ADD), form(acme, cron="* * * * *"))
    schedule = Schedule.objects.get()
    opened = admin_client.get(change_url(schedule))
    assert opened.status_code == 200
    fired_once(schedule)
    before = schedules.states([schedule.pk])[schedule.pk]
    # the operator saves the form as it was loaded, changing only the priority
    response = admin_client.post(change_url(schedule), form(acme, cron="* * * * *", priority=3))
    assert response.status_code == 302, error_text(response)
    assert schedules.states([schedule.pk])[schedule.pk] == before
    assert schedules.fire_due() == 0  # the fired slot does not fire again
    assert Message.objects.filter(task_name=TASK).count() == 1
    page = admin_client.get(change_url(schedule)).content.decode()
    assert f"#{before.last_message_id}" in page  # linked last message


def test_a_code_schedule_is_read_only_but_for_its_pause(admin_client: Client) -> None:
    schedules.sync([ScheduleSpec.build("code", {"task": TASK, "cron": "@daily"}, "code")])
    schedule = Schedule.objects.get()
    page = admin_client.get(change_url(schedule)).content.decode()
    assert 'name="cron"' not in page and 'name="enabled"' in page
    response = admin_client.post(change_url(schedule), {"enabled": ""})
    assert response.status_code == 302
    schedule.refresh_from_db()
    assert (schedule.enabled, schedule.cron) == (False, "@daily")
    assert "paused" in admin_client.get(reverse(LIST)).content.decode()
    # no delete: the next worker's sync would bring it back
    delete = reverse("admin:fairqueue_schedule_delete", args=[schedule.pk])
    assert admin_client.get(delete).status_code == 403


def test_enable_and_disable_actions(admin_client: Client, acme: Channel) -> None:
    admin_client.post(reverse(ADD), form(acme))
    schedule = Schedule.objects.get()
    action(admin_client, reverse(LIST), "disable_schedules", [schedule.pk])
    assert not Schedule.objects.get().enabled
    action(admin_client, reverse(LIST), "enable_schedules", [schedule.pk])
    assert Schedule.objects.get().enabled


def test_a_view_only_user_sees_schedules_and_changes_nothing(acme: Channel) -> None:
    schedule = Schedule.objects.create(
        name="s", channel=acme, task_name=TASK, cron="@hourly", enabled=True
    )
    viewer: User = user_with("fairqueue.view_schedule", "fairqueue.view_channel", name="viewer")
    client = client_for(viewer)
    page = client.get(reverse(LIST))
    assert page.status_code == 200 and "@hourly" in page.content.decode()
    assert b"disable_schedules" not in page.content  # no actions offered
    assert client.get(change_url(schedule)).status_code == 200
    assert client.post(change_url(schedule), form(acme, enabled="")).status_code == 403
    action(client, reverse(LIST), "disable_schedules", [schedule.pk])
    assert client.post(reverse(ADD), form(acme, name="new")).status_code == 403
    assert list(Schedule.objects.values_list("name", "enabled")) == [("s", True)]
    channel_page = client.get(reverse("admin:fairqueue_channel_change", args=[acme.pk]))
    assert channel_page.status_code == 200 and "@hourly" in channel_page.content.decode()
