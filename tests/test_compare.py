"""benchmarks/compare's fairness scenarios: the ideal fair schedule they are judged against,
their tables and goals, and a tiny run of the new scenarios for django-fairqueue and the raw
floor (the peers live in the ``compare`` tox environment only). Figures at tiny sizes mean
nothing and are never asserted beyond their shape; the real ones are in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from django_fairqueue.contrib.bench.figures import fair_completion_times

ROOT = Path(__file__).resolve().parent.parent


def test_the_ideal_fair_schedule_shares_the_workers_equally_and_by_water_filling() -> None:
    # alone with the background tenant on 2 workers: one each, 1 s of work takes 1 s
    assert fair_completion_times(2, {"x": (0.0, 1.0, 1)}, background=True) == {"x": 1.0}
    # without it, a tenant of 4 jobs uses 4 of 8 workers (no more than it has jobs)
    assert fair_completion_times(8, {"x": (0.0, 4.0, 4)}) == {"x": 1.0}
    # 8 workers, the background tenant, x (1 job) and y (10 jobs): x can use 1 worker, the
    # other 7 go to y and the background, 3.5 each; once x is done, 4 each
    done = fair_completion_times(8, {"x": (0.0, 1.0, 1), "y": (0.0, 6.0, 10)}, background=True)
    assert done["x"] == pytest.approx(1.0)
    assert done["y"] == pytest.approx(1.0 + (6.0 - 3.5) / 4)
    # a later arrival takes its share from then on: y alone had 4 workers for 1 s, then 2
    done = fair_completion_times(4, {"y": (0.0, 8.0, 10), "z": (1.0, 2.0, 10)})
    assert done["z"] == pytest.approx(2.0)
    assert done["y"] == pytest.approx(2.5)


def _cells() -> dict[str, Any]:
    sybil = {
        "variant": "fair",
        "a_backlog": 1_000_000,
        "a_keys": 100,
        "workers": "2x64",
        "rounds": 5,
        "timed_out": 0,
        "timeout_s": 60.0,
        "note": "",
        "b_p50_ms": 12.0,
        "b_p99_ms": 61.0,
        "b_max_ms": 70.0,
        "a_before_b_max": 20,
        "jain_min": 1.0,
        "a_rate": 4000.0,
        "load1": 1.5,
    }
    weights = {
        "variant": "by-time",
        "backlog": 10_000,
        "workers": "2x4",
        "a_jobs": 20,
        "b_jobs": 300,
        "a_time_share": 0.25,
        "b_time_share": 0.75,
        "jain_time": 0.99,
        "jain_count": 0.6,
        "starved_ms": 300.0,
        "starved": "A",
        "note": "",
        "load1": 1.5,
    }
    bursts = {
        "variant": "fair",
        "backlog": 10_000,
        "workers": "2x4",
        "tenants": 50,
        "unserved": 0,
        "slowdown_mean": 1.8,
        "slowdown_p50": 1.5,
        "slowdown_max": 4.2,
        "worst": "t07",
        "jain_slowdown": 0.9,
        "wait_p50_ms": 20.0,
        "wait_p99_ms": 90.0,
        "starved_ms": 150.0,
        "starved": "t07",
        "a_time_share": 0.3,
        "note": "",
        "load1": 1.5,
    }
    return {"sybil": [sybil], "weights": [weights], "bursts": [bursts]}


def test_the_new_scenarios_tables_and_goals() -> None:
    """(b), (d) and (e) get a table each; a peer without weights gets an n/a row saying what
    its users would have to do; the goals judge django-fairqueue's p99 in (b) and Jain's
    index over worker time in (d)."""
    from benchmarks.compare import report, run

    assert run.parse_args(["--fair"]).scenarios == [
        "fairness",
        "sybil",
        "timeshare",
        "weights",
        "bursts",
    ]
    ours = {"system": "django-fairqueue", "scenarios": ["sybil", "weights", "bursts"]}
    ours.update(_cells())
    pgqueuer = {
        "system": "pgqueuer",
        "scenarios": ["sybil", "weights", "bursts"],
        "sybil": [{**_cells()["sybil"][0], "variant": "fifo", "timed_out": 1, "b_p99_ms": None}],
        "weights": [],
        "bursts": [],
        # a tenant lock over a million jobs: nothing started in the window, no shares
        "timeshare": [
            {**_cells()["weights"][0], "variant": "entrypoint", "a_jobs": 0, "b_jobs": 0}
        ],
    }
    doc = {"systems": [ours, pgqueuer]}
    goals = {g["goal"]: g["met"] for g in report.goals(doc)}
    assert goals == {
        "B's p99 < 50 ms with A's backlog 1,000,000 spread over keys": False,
        "Jain over worker time >= 0.95, weights 3:1, backlog 10,000": True,
    }
    text = report.tables(doc)
    assert "(b) Sybil" in text and "(d) Weights" in text and "(e) Bursts" in text
    rows = [line for line in text.splitlines() if line.startswith("pgqueuer ")]
    assert any("n/a" in row and "no weights (below)" in row for row in rows)
    assert "pgqueuer: no weights: an entrypoint per tenant" in text
    # a round given up is reported as at least its timeout, not as a figure
    assert "> 60,000" in text
    assert "4.2 (t07)" in text
    idle = [row for row in rows if "entrypoint" in row and "no job started" in row]
    assert len(idle) == 1 and "0.99" not in idle[0]


@pytest.mark.slow
def test_the_new_fairness_scenarios_run_for_django_fairqueue_and_the_raw_floor(
    tmp_path: Path, database_url: str
) -> None:
    """The sybil, weights and bursts scenarios at tiny sizes, through real workers, on
    databases of their own next to the test database (dropped afterwards)."""
    path = tmp_path / "compare.json"
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [sys.executable, "-m", "benchmarks.compare.run", "--sizes", "tiny"]
    options = ["--system", "raw-sql", "--system", "django-fairqueue", "--db-prefix", "ctest_"]
    scenarios = ["--scenario", "sybil", "--scenario", "weights", "--scenario", "bursts"]
    result = subprocess.run(
        [*command, *options, *scenarios, "--json", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    systems = {s["system"]: s for s in json.loads(path.read_text())["systems"]}
    assert set(systems) == {"raw-sql", "django-fairqueue"}
    ours, floor = systems["django-fairqueue"], systems["raw-sql"]

    # (b): A's backlog over 10 channels of its group; B's bursts were served, and each
    # burst shared the claims with A (Jain over the first 20 jobs after B's commit)
    [sybil] = ours["sybil"]
    assert sybil["a_keys"] == 10 and sybil["rounds"] >= 1 and not sybil["timed_out"]
    assert sybil["b_p99_ms"] > 0 and sybil["jain_min"] > 0.5
    assert [c["a_keys"] for c in floor["sybil"]] == [10]
    # (d): django-fairqueue only, by time; the floor has no weights: an n/a row
    assert [c["variant"] for c in ours["weights"]] == ["by-time"]
    assert ours["weights"][0]["weights"] == {"A": 1, "B": 3}
    assert floor["weights"] == []
    assert "raw-sql: no weights (first in, first out)" in result.stdout
    # (e): every tenant of the plan served, slowdowns against the ideal fair schedule
    for cell in [*ours["bursts"], *floor["bursts"]]:
        assert cell["tenants"] == 4 and cell["unserved"] == 0
        assert 0 < cell["slowdown_mean"] <= cell["slowdown_max"]
    assert [c["variant"] for c in ours["bursts"]] == ["fair", "by-time"]
    # the databases went with the run
    with psycopg.connect(database_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'ctest%'")
        assert left.fetchall() == []


class _FakeStamps:
    def __init__(self, system: _SlowToCloseSystem) -> None:
        self.system = system

    def wait_for(self, keys: list[tuple[str, int]], timeout: float) -> list[float]:
        # the job started 2 ms after its commit
        return [self.system.commits[-1] + 0.002 for _ in keys]


class _FakeFleet:
    def __init__(self, system: _SlowToCloseSystem) -> None:
        self.stamps = _FakeStamps(system)

    def __enter__(self) -> _FakeFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def check(self) -> None:
        pass


class _SlowToCloseSystem:
    """A system whose enqueue commits, then takes 30 ms to close its connection (as a peer
    that opens a connection or an event loop per enqueue does)."""

    pickup_config = None
    variants = ["default"]

    def __init__(self) -> None:
        self.commits: list[float] = []

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass

    def worker_commands(self, config: object, variant: str) -> list[list[str]]:
        return []

    def worker_env(self) -> dict[str, str]:
        return {}

    def burst(self, tenant: str, seqs: list[int], variant: str) -> float:
        committed = time.time()
        self.commits.append(committed)
        time.sleep(0.03)  # closing the connection: not part of the job's wait
        return committed


def test_a_pickup_runs_from_the_commit_not_from_the_enqueuers_clean_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A wait measured from after the enqueue call returned would leave out the time a system
    # spends closing its connection after the commit: 2 ms would read as -28 ms.
    from benchmarks.compare import run

    system = _SlowToCloseSystem()
    monkeypatch.setattr(run, "Fleet", lambda commands, env: _FakeFleet(system))
    figures = run.pickup_cell(system, samples=5)
    assert figures["samples"] == 5
    assert all(1.9 <= ms <= 2.1 for ms in figures["latencies_ms"]), figures


def _not_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory outside any git checkout (git does not look above ``tmp_path``)."""
    source = tmp_path / "source"
    source.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return source


def test_a_baseline_outside_a_git_checkout_is_one_line_and_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from a source archive (no .git), ``--baseline main`` says what it needs and exits 2,
    before it touches the server; a ref this checkout does not have, the same way."""
    from benchmarks.compare import run

    source = _not_a_checkout(tmp_path, monkeypatch)
    monkeypatch.setattr(run, "ROOT", source)
    assert run.main(["--scenario", "enqueue", "--baseline", "main"]) == 2
    assert capsys.readouterr().err == (
        f"compare: --baseline needs a git checkout: {source} is not one\n"
    )
    monkeypatch.setattr(run, "ROOT", ROOT)
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert run.main(["--scenario", "enqueue", "--baseline", "no-such-ref"]) == 2
    assert capsys.readouterr().err == f"compare: --baseline no-such-ref: not a commit of {ROOT}\n"


def test_the_run_records_why_it_has_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    from benchmarks.compare import run

    if (ROOT / ".git").exists():
        assert set(run.describe(database_url)["git"]) == {"commit", "dirty"}
    monkeypatch.setattr(run, "ROOT", _not_a_checkout(tmp_path, monkeypatch))
    assert run.describe(database_url)["git"] == {"error": "not a git checkout"}


def test_plots_of_a_run_with_nothing_to_draw_say_so(tmp_path: Path) -> None:
    from benchmarks.compare import run

    doc = {"systems": [{"system": "django-fairqueue", "pickup": [{"p50_ms": 2.0}]}]}
    assert run.plot_lines(doc, tmp_path) == [
        f"no plot written to {tmp_path}: plots are drawn of the e2e, fairness, sybil, "
        "timeshare and weights scenarios only"
    ]
    assert list(tmp_path.iterdir()) == []
