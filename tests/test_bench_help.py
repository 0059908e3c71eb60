"""``manage.py fairbench --help``, its tables and its pages: what ``--plots`` writes, what a
``spread %`` column is, what a quick run takes, what moves the WAL figure."""

from __future__ import annotations

from pathlib import Path

from django_fairqueue.contrib.bench import plots
from django_fairqueue.contrib.bench.figures import spread_pct
from django_fairqueue.contrib.bench.management.commands.fairbench import Command
from django_fairqueue.contrib.bench.scenarios import SCENARIOS

DOCS = Path(__file__).resolve().parent.parent / "docs"
REFERENCE = DOCS / "reference/commands.md"
PERFORMANCE = DOCS / "performance.md"
#: Every file plots.write_plots can write (its module names each in a *_FILE constant).
PLOT_FILES = sorted(value for name, value in vars(plots).items() if name.endswith("_FILE"))


def test_plots_help_and_reference_name_every_file_the_plots_write() -> None:
    assert len(PLOT_FILES) >= 3
    parser = Command().create_parser("manage.py", "fairbench")
    (action,) = [a for a in parser._actions if "--plots" in a.option_strings]
    (row,) = [line for line in REFERENCE.read_text().splitlines() if "| `--plots DIR`" in line]
    for name in PLOT_FILES:
        assert name in (action.help or ""), name
        assert name in row, name


def test_the_spread_column_is_explained_under_its_tables_and_in_the_reference() -> None:
    with_spread = [s for s in SCENARIOS.values() if any(c.header == "spread %" for c in s.columns)]
    assert [s.name for s in with_spread] == ["enqueue", "claim"]
    for scenario in with_spread:
        assert any(note.startswith("spread %: ") for note in scenario.notes), scenario.name
    (row,) = [line for line in REFERENCE.read_text().splitlines() if "`--repeat N`" in line]
    assert "`spread %`" in row and "/ the median" in row
    assert spread_pct([900.0, 1_000.0, 1_200.0], 1_000.0) == 30.0
    assert spread_pct([1_000.0], 1_000.0) is None


def test_help_and_docs_say_what_a_quick_run_takes() -> None:
    """``--quick`` is smaller sizes, not a short run: about 12 minutes for every scenario; one
    ``--scenario`` is the smoke test. The help, the reference and the performance page agree."""
    parser = Command().create_parser("manage.py", "fairbench")
    (action,) = [a for a in parser._actions if "--quick" in a.option_strings]
    (row,) = [line for line in REFERENCE.read_text().splitlines() if "| `--quick`" in line]
    running = PERFORMANCE.read_text().split("## Running it", 1)[1]
    for text in (action.help or "", row, running):
        assert "12 minutes" in text and "--scenario" in text, text
        assert "1-2 minute" not in text and "a few minutes" not in text, text


def test_the_performance_page_migrates_before_the_pipeline_benchmark() -> None:
    lines = PERFORMANCE.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "manage fairpipeline bench" in line)
    assert "python3 dev.py manage migrate" in lines[first - 1]


def test_the_wal_figure_is_said_to_move_with_checkpoints_not_with_cpu_load() -> None:
    (note,) = [n for n in SCENARIOS["functions"].notes if n.startswith("claim WAL B")]
    noise = PERFORMANCE.read_text().split("**Noise.**", 1)[1].split("\n\n", 1)[0]
    for text in (note, noise):
        assert "checkpoint" in text and "full_page_writes" in text, text
        assert "does not move with the machine's load" not in text
