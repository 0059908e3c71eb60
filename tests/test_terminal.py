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


def test_columns_are_padded_and_cut_by_display_width() -> None:
    assert terminal.width("abc") == 3
    assert terminal.width("東京") == 4 and terminal.width("🎉") == 2
    assert terminal.width("e\u0301") == 1  # a combining accent takes no column
    assert terminal.aligned([("東京", "1"), ("abcde", "22")], right={1}) == [
        "東京    1",
        "abcde  22",
    ]
    assert terminal.cut("東京東京東京", 8) == "東京..."
    assert terminal.cut("東京", 4) == "東京"
    assert terminal.width(terminal.cut("a東京東京東京", 8)) <= 8


def test_command_json_writes_times_in_iso_8601() -> None:
    from datetime import UTC, date, datetime

    at = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
    assert terminal.json_text({"at": at, "day": date(2026, 12, 1)}) == (
        '{"at": "2026-12-01T03:00:00+00:00", "day": "2026-12-01"}'
    )
    with pytest.raises(TypeError, match="set is not JSON"):
        terminal.json_text({1})


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
def test_failures_list_escapes_a_newline_in_an_error_rather_than_folding_it() -> None:
    from tests.test_failures import make_failed

    make_failed("alice", 1, error="line1\nline2  x", error_type="Err\x1b[31m")
    out = io.StringIO()
    call_command("fairqueue", "failures", "list", stdout=out)
    (row,) = out.getvalue().splitlines()[1:]  # still one line
    assert row.endswith("  Err\\x1b[31m: line1\\nline2  x")  # as repr writes them, spaces kept


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


@pytest.mark.django_db
def test_usage_csv_has_names_as_stored_and_stays_valid_csv() -> None:
    """CSV is for spreadsheets and scripts: names as stored (control characters and all), and
    a field with a line break quoted, so every reader finds each row whole."""
    import csv

    from tests.test_usage import flush, yesterday_at

    names = [EVIL, "cr\ronly", "plain"]
    for name in names:
        enqueue_noop(name)
        flush(name, yesterday_at(9), ok=1, run_ms=1000)
    out = io.StringIO()
    call_command("fairqueue", "usage", "--csv", "--sort", "name", stdout=out)
    header, *rows = csv.reader(io.StringIO(out.getvalue(), newline=""))
    assert header[2] == "channel" and all(len(row) == len(header) for row in rows), rows
    assert [row[2] for row in rows] == sorted(names)


def enqueue_noop(channel: str, queue: str | None = None) -> None:
    from tests import factories

    if queue is None:
        factories.enqueue(channel)
    else:
        factories.enqueue_in_queue(queue, channel)


@pytest.mark.django_db
def test_status_sorts_by_the_name_shown_then_the_queue() -> None:
    import json

    # by the rows' own names, "reports\x1f..." would put queue reports' channels in a block
    # between acme and sierra
    shown = [
        ["acme", "default"],
        ["acme", "reports"],
        ["bravo", "reports"],
        ["sierra", "default"],
        ["zulu", "reports"],
    ]
    for channel, queue in reversed(shown):
        enqueue_noop(channel, queue)
    out = io.StringIO()
    call_command("fairqueue", "status", "--sort", "name", "--json", stdout=out)
    listed = [[c["name"], c["queue"]] for c in json.loads(out.getvalue())["channels"]]
    assert listed == shown
    table = io.StringIO()
    call_command("fairqueue", "status", "--sort", "name", stdout=table)
    assert [line.split()[:2] for line in table.getvalue().splitlines()[1:6]] == shown


@pytest.mark.django_db
def test_status_cuts_a_long_queue_name_as_it_cuts_a_channel_name() -> None:
    long_queue = "q" * 64  # the longest a queue name may be
    enqueue_noop("plain", long_queue)
    enqueue_noop(("acme", "alice"), long_queue)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    shown = "q" * 37 + "..."  # 40 columns, as a channel name
    channel_row = next(line for line in out.getvalue().splitlines() if line.startswith("plain"))
    group_row = next(line for line in out.getvalue().splitlines() if line.startswith("acme "))
    for row in (channel_row, group_row):
        assert shown in row and long_queue not in row, row


@pytest.mark.django_db
def test_tables_keep_their_columns_with_wide_characters() -> None:
    from django_fairqueue.models import Channel, Schedule

    names = ["東京テナント", "🎉party", "plain", "x" * 60, "東" * 30]
    for name in names:
        enqueue_noop(name)
    out = io.StringIO()
    call_command("fairqueue", "status", "--sort", "name", stdout=out)
    header, *rows = out.getvalue().splitlines()[: 1 + len(names)]
    # the QUEUE column (left-aligned, as the names) starts at the same terminal column in
    # every line
    start = terminal.width(header[: header.index("QUEUE")])
    for row in rows:
        assert terminal.width(row[: row.index("default")]) == start, rows
    assert "東" * 18 + "..." in out.getvalue()  # a long name is cut to 40 columns
    for name in ("東京テナント", "plain"):
        channel = Channel.objects.get(name=name)
        Schedule.objects.create(name=name, channel=channel, task_name="t", cron="@daily")
    listed = io.StringIO()
    call_command("fairqueue", "schedules", stdout=listed)
    header, *rows = listed.getvalue().splitlines()[:3]
    start = terminal.width(header[: header.index("QUEUE")])  # (left-aligned)
    for row in rows:
        assert terminal.width(row[: row.index("default")]) == start, rows


@pytest.mark.django_db
def test_every_json_output_writes_times_the_same_way() -> None:
    """schedules, status, workers: ISO 8601 with a "T", as datetime.isoformat() writes."""
    import json
    import re

    from django_fairqueue.models import Channel, Schedule
    from django_fairqueue.runtime import worker_registry

    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?[+-]\d\d:\d\d$")
    channel = Channel.objects.create(name="timed")
    Schedule.objects.create(name="nightly", channel=channel, task_name="t", cron="@daily")
    worker_registry.Registration("timed-worker", concurrency=1).register()
    out = io.StringIO()
    call_command("fairqueue", "schedules", "--json", stdout=out)
    (schedule,) = json.loads(out.getvalue())
    status = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=status)
    workers = io.StringIO()
    call_command("fairqueue", "workers", "--json", stdout=workers)
    (worker,) = json.loads(workers.getvalue())
    for stamp in (
        schedule["next_fire_at"],
        json.loads(status.getvalue())["generated_at"],
        worker["heartbeat_at"],
    ):
        assert iso.match(stamp), stamp


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


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_a_long_output_whose_reader_stops_early_exits_141(
    database_url: str, unbuffered: bool
) -> None:
    """``fairqueue status | head -1`` over many channels: the reader goes away in the middle
    of one long write. Unbuffered (PYTHONUNBUFFERED=1, python -u), Python's own stream would
    drop the rest without an error and exit 0; every command and output form exits 141."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from django_fairqueue.models import Channel, MessageState
    from tests.factories import MessageFactory, bulk_load_ready

    # well past a pipe's 64 KiB in each form: 700 table lines, long names in the JSON, and
    # failed messages with long errors (in the table each is one line cut to its columns,
    # about 300 characters: 500 of them, or the whole table fits in the pipe and the command
    # can finish writing before the reader stops)
    bulk_load_ready(700, 1, prefix="p" * 150)
    MessageFactory.create_batch(
        500,
        channel=Channel.objects.get(name=f"{'p' * 150}-00000"),
        state=MessageState.FAILED,
        last_error={"type": "RuntimeError", "message": "e" * 2000, "traceback": None},
    )
    env = {**os.environ, "DATABASE_URL": database_url, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    for argv in (
        ["status", "--limit", "5000"],
        ["status", "--limit", "5000", "--json"],
        ["failures", "list", "--json"],
        # all 500 (the default lists 100, 30 KB: the whole table fit in the pipe, and a
        # busy machine let the command finish before the reader stopped, exit 0)
        ["failures", "list", "--limit", "500"],
    ):
        read_end, write_end = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "django", "fairqueue", *argv],
                cwd=Path(__file__).resolve().parent.parent,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            os.close(write_end)  # the command's copy is the pipe's only writer
        try:
            assert os.read(read_end, 100)  # the first bytes: the command is writing
        finally:
            os.close(read_end)  # the reader stops early
        _, stderr = proc.communicate(timeout=60)
        assert "Traceback" not in stderr, (argv, stderr)
        assert proc.returncode == 141, (argv, proc.returncode, stderr)


def test_djangos_common_options_may_follow_a_subcommand_of_fairqueue() -> None:
    from django_fairqueue.management.commands.fairqueue import Command

    parser = Command().create_parser("manage.py", "fairqueue")
    # after a subcommand, and after an action of a subcommand that has actions
    for given in (
        ["status", "--json", "-v", "0", "--settings", "s", "--traceback", "--skip-checks"],
        ["failures", "list", "-v", "0", "--settings", "s", "--traceback", "--skip-checks"],
    ):
        options = vars(parser.parse_args(given))
        assert {k: options[k] for k in ("verbosity", "settings", "traceback", "skip_checks")} == {
            "verbosity": 0,
            "settings": "s",
            "traceback": True,
            "skip_checks": True,
        }
    # one given before the subcommand is kept: the subcommand's parser does not reset it
    assert parser.parse_args(["-v", "2", "status"]).verbosity == 2
    assert parser.parse_args(["status"]).verbosity == 1
