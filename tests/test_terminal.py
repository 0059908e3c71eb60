"""The progress lines the commands draw (django_fairqueue.cli.terminal and its users)."""

from __future__ import annotations

import io
import logging

import pytest
from django.core.management import call_command

from django_fairqueue.batches import ProgressBar
from django_fairqueue.cli import terminal
from django_fairqueue.contrib.bench.harness import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_fills_in_proportion_and_clamps() -> None:
    assert terminal.bar(0.0, 4) == "[....]"
    assert terminal.bar(0.5, 4) == "[##..]"
    assert terminal.bar(0.99, 4) == "[###.]"  # full only when done
    assert terminal.bar(1.0, 4) == "[####]"
    assert terminal.bar(-3.0, 4) == "[....]"
    assert terminal.bar(7.0, 4) == "[####]"


def test_throttle_allows_ten_draws_a_second_and_always_the_final_one() -> None:
    throttle = terminal.Throttle(per_second=10)
    assert throttle.due()
    assert not throttle.due()  # at once again: too soon
    assert throttle.due(final=True)


def test_plan_progress_bar_draws_the_start_skips_a_burst_and_ends_the_line() -> None:
    out = io.StringIO()
    draw = ProgressBar("plan enrich", stream=out, width=10)

    draw(0, 0.0)
    draw(5, 0.5)  # within 0.1 s of the last draw: skipped
    draw(1_234_567, 1.0)
    draw(1_234_567, 1.0)  # after the end: nothing more

    lines = out.getvalue().split("\r")[1:]
    assert len(lines) == 2
    assert lines[0].startswith("plan enrich [..........]   0% 0 rows")
    assert lines[1].startswith("plan enrich [##########] 100% 1,234,567 rows")
    assert lines[1].endswith("s\n")


def test_fairbench_progress_draws_live_only_on_a_terminal() -> None:
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        progress = Progress(3, stream)
        progress.start("claim 1 channel")
        progress.update("run 1/3", 1.0)
        progress.done("1,234 messages/s")

    assert "[1/3] claim 1 channel  [####################] run 1/3" in tty.getvalue()
    assert terminal.CLEAR_LINE in tty.getvalue()
    # not a terminal: one line per cell, no control characters
    assert pipe.getvalue().startswith("[1/3] claim 1 channel: 1,234 messages/s (")
    assert "\x1b" not in pipe.getvalue()


# ------------------------------------------------------------------------------------------------
# stored text printed by the commands: control characters escaped

EVIL = "\x1b[31mEVIL\x1b[0m\rfake\nrow"


def test_printable_escapes_control_characters_like_repr_and_keeps_the_rest() -> None:
    assert terminal.printable(EVIL) == "\\x1b[31mEVIL\\x1b[0m\\rfake\\nrow"
    assert terminal.printable("a\u2028b\x00c\x7fd\u200fe") == "a\\u2028b\\x00c\\x7fd\\u200fe"
    assert terminal.printable("café 東京 🎉 a b/c") == "café 東京 🎉 a b/c"
    # a backslash is doubled, so a name cannot print as if it held an escape
    assert terminal.printable("\\x1b") == "\\\\x1b"
    assert terminal.printable(7) == "7"


def _assert_safe(output: str) -> None:
    assert not any(ch in output for ch in "\x1b\r\x00")
    rows = [line for line in output.splitlines() if "EVIL" in line]
    assert rows
    for line in rows:
        assert "EVIL\\x1b[0m\\rfake\\nrow" in line, line  # the newline did not split the row
    assert not any(line.startswith("row") for line in output.splitlines())


@pytest.mark.django_db
def test_status_escapes_channel_and_group_names() -> None:
    from django_fairqueue import enqueue
    from tests import fairtasks

    enqueue(fairtasks.add, 1, 2, channel=EVIL)
    enqueue(fairtasks.add, 1, 2, channel=(EVIL, "member"))
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    _assert_safe(out.getvalue())
    assert "\\x1b[31mEVIL\\x1b[0m\\rfake\\nrow/member" in out.getvalue()
    alone = io.StringIO()
    call_command("fairqueue", "status", EVIL, stdout=alone)
    _assert_safe(alone.getvalue())


@pytest.mark.django_db
def test_failures_list_escapes_channel_task_and_error() -> None:
    from tests.test_failures import make_failed

    make_failed(EVIL, 1, error="\x1b]0;owned\x07 boom")
    out = io.StringIO()
    call_command("fairqueue", "failures", "list", stdout=out)
    _assert_safe(out.getvalue())
    assert "\\x1b]0;owned\\x07 boom" in out.getvalue()
    assert "\x07" not in out.getvalue()


@pytest.mark.django_db
def test_schedules_and_workers_escape_stored_names() -> None:
    from django_fairqueue.models import Channel, Schedule
    from django_fairqueue.runtime import worker_registry

    channel = Channel.objects.create(name=EVIL)
    Schedule.objects.create(name=EVIL, channel=channel, task_name=EVIL, cron="@daily")
    out = io.StringIO()
    call_command("fairqueue", "schedules", stdout=out)
    (row,) = [line for line in out.getvalue().splitlines() if "@daily" in line]
    assert row.count("\\x1b[31mEVIL\\x1b[0m\\rfake\\nrow") == 3
    _assert_safe(out.getvalue())
    worker_registry.Registration(EVIL, concurrency=1).register()  # a worker id from --worker-id
    listed = io.StringIO()
    call_command("fairqueue", "workers", stdout=listed)
    _assert_safe(listed.getvalue())


def test_the_commands_log_lines_escape_names_and_errors_but_keep_traceback_lines() -> None:
    formatter = terminal.PrintableFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError(EVIL)
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "django_fairqueue.worker", logging.ERROR, __file__, 1, "task %s failed", (EVIL,), exc_info
    )
    text = formatter.format(record)
    first, *rest = text.split("\n")
    assert first == "ERROR task \\x1b[31mEVIL\\x1b[0m\\rfake\\nrow failed"
    assert rest[0] == "Traceback (most recent call last):"
    # a traceback keeps its newlines (the exception's own among them), escapes the rest
    assert rest[-2:] == ["ValueError: \\x1b[31mEVIL\\x1b[0m\\rfake", "row"]
    assert "\x1b" not in text and "\r" not in text
    assert record.getMessage().startswith("task \x1b")  # other handlers see it as logged


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "argv",
    [
        ["fairqueue", "workers"],
        ["fairqueue", "failures", "list"],
        ["fairqueue", "status"],
    ],
)
def test_a_command_whose_reader_closed_the_pipe_exits_quietly(
    database_url: str, argv: list[str]
) -> None:
    """``manage.py fairqueue workers | head``: the reader goes away, the command ends with
    status 141 (as if SIGPIPE ended it) and no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests import fairtasks

    for i in range(3):  # something to list
        fairtasks.add.enqueue(i, i, channel=f"pipe{i}")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "django", *argv],
            cwd=Path(__file__).resolve().parent.parent,
            env={
                **os.environ,
                "DATABASE_URL": database_url,
                "DJANGO_SETTINGS_MODULE": "tests.settings",
            },
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 141, proc.stderr
