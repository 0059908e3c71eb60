"""Helpers for testing code that uses django-fairqueue.

``drain()`` runs queued messages in the test's own thread with the real worker code (claim,
run, settle), so it works inside a test's transaction (``TestCase``, ``@pytest.mark.django_db``)
and sees the test's uncommitted data. ``enqueued()`` lists what is waiting, to assert that code
enqueued what it should (a pytest-django test here; a ``TestCase`` method works alike)::

    @pytest.mark.django_db
    def test_upload_enqueues_conversion(client):
        client.post("/upload/", {...})
        [message] = enqueued(task=convert_document, channel="alice")
        assert message.payload["args"] == [42]
        assert drain() == 1

``run_worker()`` runs ``runfairworker --burst`` in a process of its own against the test's
database, for tests of the worker process itself (signals, several processes); the data it
should see must be committed (``TransactionTestCase``, ``django_db(transaction=True)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from django.conf import settings
from django.db import connections

from django_fairqueue import conf
from django_fairqueue.api import TaskSelector, name_of_task, validate_channel_name
from django_fairqueue.models import Message, MessageState
from django_fairqueue.queues import DEFAULT_QUEUE, row_name, validate_queue_name
from django_fairqueue.runtime import proctree
from django_fairqueue.worker import Worker, WorkerConfig

#: What the worker process runs: Django set up with the test's settings module, each
#: database's name replaced by the one the test uses before any connection opens (what
#: Django's test runner does in its own process), then the command line that follows.
#: Started as ``python -c WORKER_MAIN NAMES runfairworker ...``, so that ``--processes``,
#: which starts its children the way it was started itself, gives them the test's database too.
_WORKER_MAIN = """\
import json, sys
import django
django.setup()
from django.conf import settings
from django.core.management import execute_from_command_line
from django.db import connections
for alias, name in json.loads(sys.argv[1]).items():
    connections[alias].close()
    settings.DATABASES[alias]["NAME"] = connections[alias].settings_dict["NAME"] = name
execute_from_command_line(["manage.py", *sys.argv[2:]])
"""


def drain(channels: str | Sequence[str] | None = None, max_messages: int | None = None) -> int:
    """Run ready messages until none is ready (or ``max_messages`` ran); returns how many ran.

    Messages run one at a time, in the fair order workers would claim them, in the calling
    thread, and count in the statistics and usage as a worker's do. A failing task is retried
    as a worker would: a retry whose backoff has not passed is not ready, so ``drain()`` stops
    before it (set ``FAIRQUEUE['RETRY_BACKOFF_BASE'] = 0`` to run every attempt at once).
    Inside a transaction each task runs in a savepoint.
    """
    if isinstance(channels, str):
        channels = [channels]
    worker = Worker(
        WorkerConfig(
            concurrency=1,
            batch_size=1,
            channels=tuple(channels or ()),
            burst=True,
            max_messages=max_messages,
            worker_id="django_fairqueue.testing.drain",
            listen=False,
            maintenance=False,
        )
    )
    total = 0
    while max_messages is None or total < max_messages:
        handled = worker.run_once()
        if handled == 0:
            break
        total += handled
    return total


def enqueued(
    task: TaskSelector | None = None,
    channel: str | None = None,
    queue: str | None = None,
) -> list[Message]:
    """Messages waiting to run (ready or scheduled), oldest first, optionally of one task,
    channel and/or queue. ``task`` is a task name, a fairqueue task or a ``django.tasks`` task
    of a ``FairQueueBackend``; ``channel`` is a channel of ``queue`` (of the default queue
    without one), and ``queue`` alone selects every channel of that queue."""
    messages = Message.objects.filter(state__in=[MessageState.READY, MessageState.SCHEDULED])
    if task is not None:
        messages = messages.filter(task_name=name_of_task(task))
    # Checked as enqueue checks them: a name no message can have would find nothing, and the
    # test would assert on an empty list.
    if queue is not None:
        queue = validate_queue_name(queue)
    if channel is not None:
        name = validate_channel_name(channel)
        messages = messages.filter(channel__name=row_name(queue or DEFAULT_QUEUE, name))
    elif queue is not None:
        messages = messages.filter(channel__queue=queue)
    return list(messages.select_related("channel").order_by("id"))


def run_worker(
    *options: str, timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py runfairworker --burst [options]`` in a subprocess on the database this
    test uses, and return once it exits (its output captured, as text).

    A worker process started by hand reads the settings module and connects to the database
    configured there, not to the test database the test runner made (which only this process
    knows). This one is given the test's database names. It sees committed data only: call it
    from a ``TransactionTestCase`` or ``@pytest.mark.django_db(transaction=True)`` test (inside
    the test's transaction it raises ``RuntimeError``). ``override_settings`` does not reach it.

    With ``check``, an exit status other than 0 raises ``RuntimeError`` with the output. A
    worker still running after ``timeout`` seconds is killed, with its children, and
    ``RuntimeError`` says so.
    """
    alias = conf.get().DATABASE
    if connections[alias].in_atomic_block:
        raise RuntimeError(
            "run_worker() inside the test's transaction: a worker process sees committed data "
            "only. Use TransactionTestCase or @pytest.mark.django_db(transaction=True)."
        )
    module = getattr(settings, "SETTINGS_MODULE", None)
    if not module:
        raise RuntimeError(
            "run_worker() needs a settings module (DJANGO_SETTINGS_MODULE) for the worker "
            "process to start with; these settings were configured in code"
        )
    names = {name: connections[name].settings_dict["NAME"] for name in connections}
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        # the test's import path (the project root the test runner added), so the worker
        # imports the same settings and task modules
        "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
    }
    command = [
        sys.executable,
        "-c",
        _WORKER_MAIN,
        json.dumps(names),
        "runfairworker",
        "--burst",
        *options,
    ]
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which a timeout kills
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            stdout, stderr = process.communicate()
            raise RuntimeError(
                f"runfairworker --burst {' '.join(options)} still ran after {timeout:g} s and "
                f"was killed; its output:\n{stdout}{stderr}"
            ) from None
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"runfairworker --burst {' '.join(options)} exited with status {done.returncode}; "
            f"its output:\n{stdout}{stderr}"
        )
    return done


def _kill_tree(pid: int) -> None:
    """Kill the process group of ``pid`` and those of every process below it: a supervisor
    (``--processes``) starts each child in a session of its own, and a child outliving its
    supervisor only gets SIGTERM, which lets it finish its running tasks. The supervisor is
    stopped first, so that it starts no child while the tree is read. Below ``pid`` is read
    from ``/proc`` (Linux); elsewhere only its own group is killed."""
    os.killpg(pid, signal.SIGSTOP)
    groups = [pid, *proctree.descendants(pid, proctree.read() or {})]
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
