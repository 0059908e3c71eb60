"""``manage.py fairbench --help``: what it says ``--plots`` writes."""

from __future__ import annotations

from pathlib import Path

from django_fairqueue.contrib.bench import plots
from django_fairqueue.contrib.bench.management.commands.fairbench import Command

#: Every file plots.write_plots can write (its module names each in a *_FILE constant).
PLOT_FILES = sorted(value for name, value in vars(plots).items() if name.endswith("_FILE"))


def test_plots_help_and_reference_name_every_file_the_plots_write() -> None:
    assert len(PLOT_FILES) >= 3
    parser = Command().create_parser("manage.py", "fairbench")
    (action,) = [a for a in parser._actions if "--plots" in a.option_strings]
    reference = Path(__file__).resolve().parent.parent / "docs/reference/commands.md"
    (row,) = [line for line in reference.read_text().splitlines() if "| `--plots DIR`" in line]
    for name in PLOT_FILES:
        assert name in (action.help or ""), name
        assert name in row, name
