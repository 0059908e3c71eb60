"""Security (issue 6): workers run only registered tasks, payloads are JSON and never pickle,
the admin and its actions need staff status and model permissions, the dashboard and metrics
show nothing to outsiders, and no secret reaches the logs."""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import pkgutil
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.contrib import admin
from django.contrib.auth.models import AnonymousUser, Permission, User
from django.db import connection
from django.test import Client, RequestFactory
from django.urls import reverse

import django_fairqueue
from django_fairqueue import db, enqueue, task
from django_fairqueue.db import pg
from django_fairqueue.exceptions import PayloadError
from django_fairqueue.models import Channel, Message, MessageState, WorkBatch
from django_fairqueue.worker import Worker, WorkerConfig
from tests import fairtasks
from tests.factories import NOOP
from tests.workerkit import WorkerProcess, enqueue_raw, wait_until

CAPTURED: list[tuple[tuple[Any, ...], dict[str, Any]]] = []


@task(name="tests.security.capture")
def capture(*args: Any, **kwargs: Any) -> None:
    CAPTURED.append((args, kwargs))


#: Names a hostile row could carry: callables by import path, and a registered task's import
#: path (its registered name is "tests.fair.exit").
IMPORT_PATHS = [
    "os.system",
    "subprocess.call",
    "builtins.exec",
    "builtins.eval",
    "importlib.import_module",
    "tests.fairtasks.exit_process",
    "django_fairqueue.worker.Worker",
    "os:system",
]


# ------------------------------------------------------------------------------------------
# Workers import only registered tasks


@pytest.mark.django_db
@pytest.mark.parametrize("name", IMPORT_PATHS)
def test_a_row_naming_an_import_path_fails_and_nothing_is_imported_or_called(
    name: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    mid = enqueue_raw("evil", name, f'{{"args": ["touch {marker}"], "kwargs": {{}}}}')
    worker = Worker(WorkerConfig(worker_id="security"))
    worker._discover()  # the configured task modules, imported before the message is seen
    # The statement files, read on first use through importlib (which the test forbids below):
    # read now, so that the test passes alone as in a full run.
    for module in pkgutil.iter_modules(db.__path__):
        queries = getattr(importlib.import_module(f"{db.__name__}.{module.name}"), "queries", None)
        if isinstance(queries, pg.StatementFile):
            queries()
    with (
        mock.patch.object(os, "system", side_effect=AssertionError("called")) as system,
        mock.patch.object(subprocess, "call", side_effect=AssertionError("called")) as call,
        mock.patch.object(os, "_exit", side_effect=AssertionError("called")) as exit_,
        mock.patch.object(
            importlib, "import_module", side_effect=AssertionError("imported")
        ) as imp,
    ):
        assert worker.run_once() == 1
    for spy in (imp, system, call, exit_):
        spy.assert_not_called()
    failed = Message.objects.get(pk=mid)
    assert (failed.state, failed.attempts) == (MessageState.FAILED, 1)
    assert failed.last_error["type"] == "django_fairqueue.exceptions.UnknownTask"
    assert failed.last_error["traceback"] is None
    assert not marker.exists()


# ------------------------------------------------------------------------------------------
# JSON, never pickle


@pytest.mark.django_db
def test_queue_columns_holding_data_are_jsonb() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_name LIKE 'fairqueue_%%' AND data_type IN ('bytea', 'jsonb', 'json')"
        )
        columns = {(t, c): d for t, c, d in cursor.fetchall()}
    assert columns[("fairqueue_message", "payload")] == "jsonb"
    assert columns[("fairqueue_message", "result")] == "jsonb"
    assert columns[("fairqueue_message", "last_error")] == "jsonb"
    assert "bytea" not in columns.values(), columns


def test_the_package_never_imports_a_deserialiser_of_code() -> None:
    """pickle, marshal, shelve, dill, cloudpickle, jsonpickle and yaml can build objects that
    run code; no module of django_fairqueue imports them."""
    banned = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle", "yaml"}
    root = Path(django_fairqueue.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in banned]
    assert found == []


@pytest.mark.django_db
def test_objects_cannot_be_enqueued_and_object_looking_json_stays_data() -> None:
    import pickle

    with pytest.raises(PayloadError):
        enqueue(capture, pickle.dumps(print), channel="p")
    with pytest.raises(PayloadError):
        enqueue(capture, Exception("x"), channel="p")
    CAPTURED.clear()
    hostile = [
        {"py/object": "os.system", "py/reduce": [{"py/function": "os.system"}]},
        {"__reduce__": ["os.system", ["id"]]},
        "gASVIQAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAJpZJSFlFKULg==",  # a pickle, base64
    ]
    enqueue_raw(
        "p",
        "tests.security.capture",
        json.dumps({"args": hostile, "kwargs": {}}),
    )
    assert Worker(WorkerConfig(worker_id="json")).run_once() == 1
    (call,) = CAPTURED
    assert call == (tuple(hostile), {})  # plain dicts and a string, nothing rebuilt


@pytest.mark.django_db
def test_an_int_past_pythons_text_limit_is_refused_and_nothing_stored() -> None:
    # Python turns ints of at most 4,300 digits into text (sys.get_int_max_str_digits())
    CAPTURED.clear()
    enqueue(capture, 10**4299, channel="p")  # 4,300 digits: stored, and comes back equal
    assert Worker(WorkerConfig(worker_id="json")).run_once() == 1
    assert CAPTURED == [((10**4299,), {})]
    with pytest.raises(PayloadError, match="not JSON serialisable: Exceeds the limit"):
        enqueue(capture, 10**4300, channel="p")
    assert Worker(WorkerConfig(worker_id="json")).run_once() == 0


# ------------------------------------------------------------------------------------------
# Admin: staff status and model permissions


@pytest.fixture
def data() -> dict[str, Any]:
    channel = Channel.objects.create(name="secret-tenant")
    failed = enqueue_raw("secret-tenant", "no.such.task", '{"args": [], "kwargs": {}}')
    Worker(WorkerConfig(worker_id="admin-data", channels=["secret-tenant"])).run_once()
    mid = enqueue(NOOP, channel="secret-tenant")
    batch = WorkBatch.objects.create(
        job_name="secret-job", channel=channel, start_id=1, end_id=10, state="failed"
    )
    return {"channel": channel.pk, "message": mid, "failed": failed, "batch": batch.pk}


def fairqueue_urls(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(method, url) of every admin page and endpoint of the app, with a real object id."""
    objects = {"channel": data["channel"], "message": data["message"], "workbatch": data["batch"]}
    urls: list[tuple[str, str]] = []
    for model in ("channel", "message", "workbatch"):
        pk = objects[model]
        urls += [
            ("GET", reverse(f"admin:fairqueue_{model}_changelist")),
            ("GET", reverse(f"admin:fairqueue_{model}_add")),
            ("GET", reverse(f"admin:fairqueue_{model}_change", args=[pk])),
            ("POST", reverse(f"admin:fairqueue_{model}_change", args=[pk])),
            ("GET", reverse(f"admin:fairqueue_{model}_history", args=[pk])),
            ("GET", reverse(f"admin:fairqueue_{model}_delete", args=[pk])),
            ("POST", reverse(f"admin:fairqueue_{model}_delete", args=[pk])),
        ]
    urls += [
        ("GET", reverse("admin:fairqueue_channel_dashboard")),
        ("GET", reverse("admin:fairqueue_channel_dashboard_data")),
        ("POST", reverse("admin:fairqueue_workbatch_retry_job")),
    ]
    return urls


def user_with(name: str, *perms: str, staff: bool = True) -> User:
    user = User.objects.create_user(name, password="pw", is_staff=staff)
    for perm in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="fairqueue", codename=perm)
        )
    return User.objects.get(pk=user.pk)


def client_for(user: User | None) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def request_all(client: Client, data: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for method, url in fairqueue_urls(data):
        if method == "GET":
            yield url, client.get(url)
        else:
            yield url, client.post(url, {"job": "secret-job", "weight": 5, "post": "yes"})


SENSITIVE = (b"secret-tenant", b"secret-job", b"no.such.task")


@pytest.mark.django_db
def test_anonymous_and_non_staff_users_are_sent_to_the_login_page_everywhere(
    data: dict[str, Any],
) -> None:
    everything = [
        p.codename for p in Permission.objects.filter(content_type__app_label="fairqueue")
    ]
    outsider = user_with("outsider", *everything, staff=False)
    for client in (client_for(None), client_for(outsider)):
        for url, response in request_all(client, data):
            assert response.status_code == 302, url
            assert response["Location"].startswith(reverse("admin:login")), url
            for word in SENSITIVE:
                assert word not in response.content, (url, word)
    assert_nothing_changed(data)


@pytest.mark.django_db
def test_staff_without_permissions_get_403_everywhere(data: dict[str, Any]) -> None:
    client = client_for(user_with("bare-staff"))
    for url, response in request_all(client, data):
        assert response.status_code == 403, (url, response.status_code)
        for word in SENSITIVE:
            assert word not in response.content, (url, word)
    assert_nothing_changed(data)


def assert_nothing_changed(data: dict[str, Any]) -> None:
    channel = Channel.objects.get(pk=data["channel"])
    assert (channel.weight, channel.paused) == (1, False)
    assert Message.objects.get(pk=data["message"]).state == MessageState.READY
    assert Message.objects.get(pk=data["failed"]).state == MessageState.FAILED
    assert WorkBatch.objects.get(pk=data["batch"]).state == "failed"


@pytest.mark.django_db
@pytest.mark.parametrize("model", [Channel, Message, WorkBatch])
def test_view_permission_alone_offers_no_action(model: type[Any]) -> None:
    model_admin = admin.site._registry[model]
    codename = f"view_{model._meta.model_name}"

    def actions(user: User) -> set[str]:
        request = RequestFactory().get("/")
        request.user = user
        return set(model_admin.get_actions(request))

    viewer = user_with(f"viewer-{codename}", codename)
    assert actions(viewer) == set()
    boss = User.objects.create_superuser(f"boss-{codename}", password="pw")
    assert actions(boss), "a superuser sees the actions: the check above can fail"


@pytest.mark.django_db
def test_every_action_posted_without_its_permission_changes_nothing(data: dict[str, Any]) -> None:
    viewers = {
        "channel": client_for(user_with("v1", "view_channel")),
        "message": client_for(user_with("v2", "view_message")),
        "workbatch": client_for(user_with("v3", "view_workbatch")),
    }
    ids = {
        "channel": [data["channel"]],
        "message": [data["message"], data["failed"]],
        "workbatch": [data["batch"]],
    }
    for model, client in viewers.items():
        names = list(
            admin.site._registry[
                {"channel": Channel, "message": Message, "workbatch": WorkBatch}[model]
            ].actions
        )
        names.append("delete_selected")
        for name in names:
            client.post(
                reverse(f"admin:fairqueue_{model}_changelist"),
                {"action": name, "_selected_action": [str(i) for i in ids[model]], "post": "yes"},
            )
    assert_nothing_changed(data)


# ------------------------------------------------------------------------------------------
# Metrics: nothing for outsiders, and the token never logged


@pytest.mark.django_db
def test_metrics_show_no_data_without_access_and_never_log_the_token(
    data: dict[str, Any], settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("prometheus_client")
    from django_fairqueue import metrics

    token = "tok-9f8e7d6c5b4a"
    settings.FAIRQUEUE_METRICS_TOKEN = token

    def get(auth: str | None = None, user: Any = None) -> Any:
        headers = {"HTTP_AUTHORIZATION": auth} if auth else {}
        request = RequestFactory().get("/metrics", **headers)
        request.user = user or AnonymousUser()
        return metrics.metrics_view(request)

    caplog.set_level(logging.DEBUG)
    refused = [
        get(),
        get("Bearer wrong"),
        get(f"Basic {token}"),
        get(f"Bearer {token[:-1]}"),
        get(user=user_with("m-staff")),
    ]
    for response in refused:
        assert response.status_code in (401, 403)
        assert b"secret-tenant" not in response.content
        assert token.encode() not in response.content
    allowed = get(f"Bearer {token}")
    assert allowed.status_code == 200
    assert b"secret-tenant" in allowed.content  # the check above can fail
    assert token not in caplog.text


# ------------------------------------------------------------------------------------------
# No secret in the logs of a worker process


PASSWORD = "Pw-4e1d2c3b-not-in-logs"


def with_password(url: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    credentials, host = rest.split("@", 1) if "@" in rest else ("postgres", rest)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:{password}@{host}"


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 right now."""
    import socket

    while True:
        sockets = [socket.socket()]
        try:
            sockets[0].bind(("127.0.0.1", 0))
            first = sockets[0].getsockname()[1]
            for port in range(first + 1, first + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()


def _scrape(port: int) -> str | None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def _claims(port: int) -> float:
    """How many claims the worker serving ``port`` timed (0: none, or nothing answers)."""
    found = re.search(
        r"^fairqueue_claim_duration_seconds_count (\S+)$", _scrape(port) or "", re.MULTILINE
    )
    return float(found.group(1)) if found else 0.0


@pytest.mark.django_db(transaction=True)
def test_each_worker_process_serves_its_claim_metrics_on_its_own_port(database_url: str) -> None:
    """`runfairworker --processes 2 --metrics-port P`: worker i answers on P+i with the claim
    latency it measured; the supervisor, which claims nothing, serves none."""
    pytest.importorskip("prometheus_client")
    port = _free_ports(3)
    worker = WorkerProcess(
        database_url,
        "metrics",
        "--processes",
        "2",
        "--metrics-port",
        str(port),
        overrides={"POLL_INTERVAL": 0.2},
    )
    try:
        for own in (port, port + 1):
            wait_until(lambda own=own: _claims(own) >= 1, 30, f"claim metrics on port {own}")
        assert _scrape(port + 2) is None
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.output
    finally:
        worker.close()
    assert _scrape(port) is None and _scrape(port + 1) is None  # gone with their workers


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--metrics-port", "0"], "--metrics-port must be at least 1"),
        (["--metrics-port", "65535", "--processes", "2"], "port 65536, past 65535"),
        (["--metrics-addr", "0.0.0.0"], "--metrics-addr needs --metrics-port"),
    ],
)
def test_metrics_port_values_are_checked_before_the_worker_starts(
    options: list[str], message: str
) -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("runfairworker", "--burst", *options)


def test_a_metrics_port_in_use_stops_the_worker_naming_the_address() -> None:
    import socket

    from django.core.management import CommandError, call_command

    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            call_command("runfairworker", "--burst", "--metrics-port", str(port))


def test_metrics_port_without_prometheus_client_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import builtins
    import sys

    from django.core.management import CommandError, call_command

    real_import = builtins.__import__

    def hiding(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    # as if never imported (restored afterwards), so the command imports it afresh
    monkeypatch.delitem(sys.modules, "django_fairqueue.metrics", raising=False)
    monkeypatch.delattr(django_fairqueue, "metrics", raising=False)
    monkeypatch.setattr(builtins, "__import__", hiding)
    with pytest.raises(
        CommandError,
        match=re.escape(
            "--metrics-port: django_fairqueue.metrics needs prometheus-client: "
            "pip install django-fairqueue[prometheus]"
        ),
    ):
        call_command("runfairworker", "--burst", "--metrics-port", "9100")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_worker_logs_hold_no_password_or_secret_key(database_url: str, tmp_path: Path) -> None:
    """A worker at debug verbosity, with a password in DATABASE_URL (trust authentication
    ignores it), runs hostile, failing and good messages; another cannot reach its database
    at all. Neither log shows the password or SECRET_KEY."""
    from django.conf import settings

    marker = tmp_path / "pwned"
    bad = enqueue_raw("logs", "os.system", f'{{"args": ["touch {marker}"], "kwargs": {{}}}}')
    boom = fairtasks.boom.enqueue(f"kaboom {PASSWORD[:3]}", channel="logs")
    good = fairtasks.record.enqueue("fine", channel="logs")
    overrides = {"LEASE_SECONDS": 2, "POLL_INTERVAL": 0.3, "RETRY_BACKOFF_BASE": 0}
    worker = WorkerProcess(
        with_password(database_url, PASSWORD),
        "logs",
        "--verbosity",
        "2",
        overrides=overrides,
    )
    unreachable = WorkerProcess(
        f"postgres://postgres:{PASSWORD}@127.0.0.1:9/nowhere",
        "unreachable",
        "--verbosity",
        "2",
        overrides=overrides,
    )
    try:
        wait_until(
            lambda: (
                set(
                    Message.objects.filter(pk__in=[bad, boom, good]).values_list("state", flat=True)
                )
                <= {"succeeded", "failed"}
                and Message.objects.filter(pk__in=[bad, boom, good]).count() == 3
            ),
            60,
            "the three messages final",
        )
        deadline = time.monotonic() + 30
        while unreachable.proc.poll() is None and "127.0.0.1" not in unreachable.output:
            assert time.monotonic() < deadline, unreachable.output
            time.sleep(0.2)
        worker.signal(signal.SIGTERM)
        worker.wait(30)
    finally:
        worker.close()
        unreachable.close()
    logs = worker.output + unreachable.output
    assert "os.system" in worker.output  # the worker did log what it refused
    assert "127.0.0.1" in unreachable.output  # and the other its connection failure
    assert PASSWORD not in logs
    assert settings.SECRET_KEY not in logs
    assert not marker.exists()
    assert Message.objects.get(pk=bad).last_error["type"].endswith("UnknownTask")
