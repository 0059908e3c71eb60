"""The progress lines the commands draw (django_fairqueue.terminal and its users)."""

from __future__ import annotations

import io

from django_fairqueue import terminal
from django_fairqueue.batches import ProgressBar
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
