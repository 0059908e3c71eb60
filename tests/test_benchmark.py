"""``manage.py fairbench``: structure of its results and its refusal to touch queue data.

These run the benchmark with its tiny sizes (a fraction of a second per cell): the figures are
meaningless and never asserted beyond being positive. The real figures are in
docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection
from psycopg import sql

from django_fairqueue import enqueue
from django_fairqueue.contrib.bench import db, pickup, plots, runner, sizes
from django_fairqueue.contrib.bench.database import SCRATCH_COMMENT, scratch_name
from django_fairqueue.contrib.bench.e2e import E2EResult
from django_fairqueue.contrib.bench.e2e import finish as e2e_finish
from django_fairqueue.contrib.bench.fairness import FairnessResult, burst_figures
from django_fairqueue.contrib.bench.figures import jain_index, percentile
from django_fairqueue.contrib.bench.management.commands.fairbench import Command as FairbenchCommand
from django_fairqueue.contrib.bench.scenarios import SCENARIOS
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.models import Message

ROOT = Path(__file__).resolve().parent.parent


def fairbench(*args: str) -> str:
    out = StringIO()
    call_command("fairbench", "--sizes", "tiny", "--no-progress", *args, stdout=out, stderr=out)
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_tiny_run_reports_every_scenario_as_json(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    output = fairbench("--json", str(path))

    doc = json.loads(path.read_text())
    assert doc["schema"] == 1
    assert set(doc["scenarios"]) == set(SCENARIOS)
    meta = doc["meta"]
    assert meta["sizes"]["name"] == "tiny"
    assert meta["database"]["name"] == connection.settings_dict["NAME"]
    assert meta["database"]["server"]["server_version"]
    assert "fairqueue_claim_v1" in meta["database"]["functions"]
    assert meta["wall_seconds"] > 0
    for name, scenario in SCENARIOS.items():
        cells = doc["scenarios"][name]["cells"]
        assert len(cells) == len(scenario.plan(sizes.TINY)), name
        assert scenario.title in output
        for cell in cells:
            assert cell[scenario.metric] > 0, (name, cell)

    for cell in doc["scenarios"]["enqueue"]["cells"]:
        assert cell["messages"] > 0 and cell["calls"] > 0
    claim_cells = doc["scenarios"]["claim"]["cells"]
    assert {(c["batch"], c["mode"]) for c in claim_cells} == {(1, "separate"), (10, "separate")}
    for cell in claim_cells:
        assert cell["messages"] > 0 and cell["claims"] > 0
        assert 0 <= cell["empty_pct"] <= 100
        assert cell["per_claim"] <= cell["batch"]
    for cell in doc["scenarios"]["latency"]["cells"]:
        assert cell["samples"] == sizes.TINY.latency_samples
        assert 0 < cell["claim_p50_ms"] <= cell["claim_p95_ms"] <= cell["claim_max_ms"]
        assert cell["per_claim"] == sizes.TINY.latency_batch
    for cell in doc["scenarios"]["fairness"]["cells"]:
        assert cell["rounds"] == sizes.TINY.fairness_rounds
        assert 0.5 <= cell["jain_min"] <= 1.0
        assert 0 < cell["b_wait_p50_ms"] <= cell["b_wait_p99_ms"] <= cell["b_wait_max_ms"]
        assert cell["claims_before_b_max"] >= 1
    snapshot_cells = doc["scenarios"]["snapshot"]["cells"]
    assert [(c["series"], c["cycles"]) for c in snapshot_cells] == [
        ("held", 0),
        ("held", 20),
        ("none", 0),
        ("none", 20),
    ]
    for cell in snapshot_cells:
        assert cell["samples"] == sizes.TINY.snapshot_samples
        assert 0 < cell["claim_p50_ms"] <= cell["claim_p95_ms"]
        assert (cell["cycles_per_second"] > 0) == (cell["cycles"] > 0)
        # a cycle reads the claim's walk and the settlement's primary key at least
        assert cell["index_reads_per_cycle"] >= 2
        assert re.fullmatch(r"(fq|fairqueue)_\w+ \d+%", cell["most_read_index"]), cell
        assert cell["most_read_index"].startswith(next(iter(cell["index_reads"])))
        assert sum(cell["index_reads"].values()) == pytest.approx(
            cell["index_reads_per_cycle"], abs=1
        )
    assert [c["vs_first"] for c in snapshot_cells if c["cycles"] == 0] == [1.0, 1.0]
    schedule_cells = doc["scenarios"]["schedules"]["cells"]
    assert [(c["schedules"], c["due"]) for c in schedule_cells] == [(10, 0), (10, 2)]
    for cell in schedule_cells:
        assert cell["samples"] == sizes.TINY.schedules_samples
        assert 0 < cell["pass_p50_ms"] <= cell["pass_p95_ms"]
        assert cell["first_pass_per_schedule_ms"] > 0
        assert (cell["per_fire_ms"] is None) == (cell["due"] == 0)
    function_cells = doc["scenarios"]["functions"]["cells"]
    assert [(c["case"], c["batch"], c["by"]) for c in function_cells] == [
        ("empty", 1, "count"),
        ("empty", 1, "time"),
        ("backlog", 1, "count"),
        ("backlog", 1, "time"),
        ("key-queued", 1, "count"),
        ("key-active", 1, "count"),
        ("backlog", 10, "count"),
        ("backlog", 10, "time"),
        ("key-queued", 10, "count"),
        ("key-active", 10, "count"),
    ]
    cost_cells = doc["scenarios"]["enqueue_cost"]["cells"]
    assert [c["mode"] for c in cost_cells] == [
        "single",
        "batch",
        "single-key",
        "batch-key",
        "single-held",
        "single-key-active",
        "batch-key-active",
        "single-key-held-running",
    ]
    for cell in cost_cells:
        assert cell["server_us"] > 0 and cell["client_us"] > 0
    for cell in function_cells:
        # A claim's time includes the housekeeping calls it makes first: only those its probe
        # finds work for (an idle poll makes none; nothing scheduled is ever due)
        assert cell["claim_us"] >= cell["claim_body_us"] > 0
        assert cell["promote_us"] == 0
        assert cell["case"] != "empty" or cell["fold_us"] == cell["quiet_us"] == 0
        # a claim that takes messages writes WAL (their rows); the empty one writes none
        assert (cell["claim_wal_bytes"] is None) == (cell["case"] == "empty")
        assert cell["case"] == "empty" or cell["claim_wal_bytes"] > 0
        assert cell["claim_us"] == pytest.approx(
            cell["claim_body_us"] + cell["promote_us"] + cell["fold_us"] + cell["quiet_us"],
            abs=0.5,
        )
        assert (cell["complete_us"] is None) == (cell["case"] == "empty")
    # e2e and pickup ran real `runfairworker` subprocesses on this (the test) database.
    (e2e,) = doc["scenarios"]["e2e"]["cells"]
    assert (e2e["channels"], e2e["processes"], e2e["threads"], e2e["prefetch"]) == (3, 1, 2, 4)
    assert e2e["backlog"] == sizes.TINY.e2e_min_backlog
    assert e2e["failed"] == 0
    assert e2e["drain_rate"] > 0 and e2e["startup_s"] > 0 and e2e["wall_s"] > e2e["drain_s"]
    assert e2e["best"] is True  # the only cell is the fastest
    (pickup,) = doc["scenarios"]["pickup"]["cells"]
    assert pickup["mode"] == "listen"
    assert pickup["samples"] == sizes.TINY.pickup_samples
    assert 0 < pickup["p50_ms"] <= pickup["p99_ms"] <= pickup["max_ms"]
    assert {t["name"] for t in doc["targets"]} >= {"enqueue, batch of 100"}
    assert "pickup latency with LISTEN, p50" in {t["name"] for t in doc["targets"]}
    assert "Targets" in output

    # It leaves the queue as empty as it found it.
    assert db.select_queue_tables_in_use() == dict.fromkeys(
        ("messages", "channels", "channel_deltas", "work_batches", "schedules"), False
    )


@pytest.mark.django_db(transaction=True)
def test_refuses_a_database_holding_queue_rows() -> None:
    import django_fairqueue.contrib.bench.tasks  # noqa: F401  (registers the task)

    kept = enqueue(NOOP_TASK_NAME, channel="someone-else")
    with pytest.raises(CommandError, match=r"holds queue data .*--scratch"):
        fairbench("--scenario", "latency")
    assert Message.objects.filter(pk=kept).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_scratch_runs_elsewhere_and_leaves_the_data_alone(
    tmp_path: Path, database_url: str
) -> None:
    # In a subprocess, as a user runs it: pytest-django forbids connections through the
    # temporary alias the scratch database gets, which is what the command does.
    import django_fairqueue.contrib.bench.tasks  # noqa: F401

    kept = enqueue(NOOP_TASK_NAME, channel="someone-else")
    path = tmp_path / "bench.json"
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "django", "fairbench", "--settings", "tests.settings"]
    options = ["--sizes", "tiny", "--scratch", "--scenario", "latency", "--where", "channels=2"]
    result = subprocess.run(
        [*command, *options, "--json", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr

    doc = json.loads(path.read_text())
    scratch = scratch_name(connection.settings_dict["NAME"])
    assert doc["meta"]["database"]["name"] == scratch
    assert doc["meta"]["scratch"] is True
    # a fresh database: its functions are those of the checked-out db/functions/
    assert not [w for w in doc["meta"]["warnings"] if "differ" in w]
    assert [c["channels"] for c in doc["scenarios"]["latency"]["cells"]] == [2]
    assert "Claim latency" in result.stdout
    assert f"creating scratch database {scratch!r}" in result.stderr
    assert Message.objects.filter(pk=kept).exists()
    # dropped afterwards
    assert db.select_database_comment(scratch) == (False, None)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_scratch_run_cleans_up_and_says_so(database_url: str, sig: int) -> None:
    """SIGTERM (as a process manager or `timeout` sends) stops a --scratch run as Ctrl-C does:
    its worker stopped, its scratch database dropped, one line, status 128 + the signal."""
    scratch = scratch_name(connection.settings_dict["NAME"])
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "django", "fairbench", "--settings", "tests.settings"]
    proc = subprocess.Popen(
        [*command, "--sizes", "tiny", "--scratch", "--scenario", "pickup"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (workers := _children(proc.pid)):  # its runfairworker, in the scratch database
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        assert db.select_database_comment(scratch) == (True, SCRATCH_COMMENT)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # our own child, by its pid
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == f"fairbench: run stopped by {signal.Signals(sig).name}"
    assert db.select_database_comment(scratch) == (False, None)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


@pytest.mark.django_db(transaction=True)
def test_scratch_never_drops_a_database_it_did_not_create() -> None:
    scratch = scratch_name(connection.settings_dict["NAME"])
    db.create_scratch_database(scratch, comment="somebody's data")
    try:
        with pytest.raises(CommandError, match="not a fairbench scratch database"):
            fairbench("--scratch", "--scenario", "latency")
        assert db.select_database_comment(scratch) == (True, "somebody's data")
    finally:
        db.drop_scratch_database(scratch)


@pytest.mark.django_db(transaction=True)
def test_a_scratch_run_keeps_out_another_scratch_run_only() -> None:
    """A --scratch run locks its scratch database, not the one it was started on: a plain run
    there goes ahead, another --scratch run is refused with the database in use."""
    name = connection.settings_dict["NAME"]
    scratch = scratch_name(name)
    in_use = "another fairbench run is using database"
    with db.lock_benchmark(scratch=True) as held:  # as a --scratch run holds it
        assert held
        with pytest.raises(CommandError, match=f"{in_use} '{scratch}'"):
            fairbench("--scratch", "--scenario", "latency")
        assert "Claim latency" in fairbench("--scenario", "latency", "--where", "channels=2")
    with db.lock_benchmark() as held:  # as a plain run holds it
        assert held
        with pytest.raises(CommandError, match=f"{in_use} '{name}'"):
            fairbench("--scenario", "latency")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--where", "colour=blue"], "no cell has field"),
        (["--where", "batch"], "FIELD=VALUE"),
        (["--scenario", "claim", "--where", "batch=7"], "selects no cell"),
        (["--duration", "0"], "positive"),
        (["--keep-scratch"], "needs --scratch"),
    ],
)
def test_rejects_bad_options(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        fairbench(*args)


@pytest.mark.parametrize(
    ("args", "preset"),
    [([], "full"), (["--quick"], "quick"), (["--sizes", "tiny"], "tiny")],
)
def test_size_presets(args: list[str], preset: str) -> None:
    parser = FairbenchCommand().create_parser("manage.py", "fairbench")
    assert parser.parse_args(args).sizes == preset


def test_percentile_interpolates_between_ranks() -> None:
    values: list[Any] = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_scratch_name_fits_an_identifier() -> None:
    assert scratch_name("app") == "app_fairbench"
    assert len(scratch_name("x" * 80).encode()) == 63
    assert SCRATCH_COMMENT


def test_jain_index() -> None:
    assert jain_index([10, 10]) == 1.0
    assert jain_index([1, 0]) == 0.5
    assert jain_index([10_000, 10]) == pytest.approx(0.501, abs=1e-3)
    assert jain_index([0, 0]) == 1.0


def test_fairness_jain_runs_over_the_claims_the_other_columns_count() -> None:
    """One claimer taking 10 at a time, B's burst of 10: a claim that started before the client
    read its commit's time (a busy client) took 5 of A and 5 of B, the next the same, then A
    alone. A before B 10 in 2 claims, so the first 20 messages were 10 and 10: Jain 1.0."""
    committed = 100.0
    records = [
        (99.0, 99.5, 10, []),  # before B's commit: in no column
        (99.9, 100.01, 5, [(i, 99.95, 100.01) for i in range(1, 6)]),
        (100.02, 100.03, 5, [(i, 99.95, 100.03) for i in range(6, 11)]),
        (100.04, 100.05, 10, []),
    ]
    figures = burst_figures(records, list(range(1, 11)), committed)
    assert (figures.a_before, figures.claims, figures.jain) == (10, 2, 1.0)
    assert figures.waits_ms == pytest.approx([60.0] * 5 + [80.0] * 5)


@pytest.mark.usefixtures("by_count")
@pytest.mark.django_db(transaction=True)
def test_a_fairness_row_agrees_with_itself() -> None:
    """The tiny run of one claimer, batch and burst of 10 (as the quick run's first row): when
    no burst waited for more A messages than its own size, its window held all of B and at
    most as many of A, so the first 2 x burst messages split evenly: Jain 1.0."""
    tiny = dataclasses.replace(
        sizes.TINY,
        fairness_backlogs=(3_000,),
        fairness_processes=(1,),
        fairness_burst=10,
        fairness_rounds=4,
    )
    report = runner.run([SCENARIOS["fairness"]], tiny, using=connection.alias)
    (cell,) = report.scenarios["fairness"].results
    assert cell.a_left > 0  # A had ready messages throughout
    assert cell.a_before_b_max <= cell.burst, cell
    assert cell.jain_min == 1.0, cell


@pytest.mark.django_db(transaction=True)
def test_pickup_reads_its_clock_before_the_enqueue_commits(database_url: str) -> None:
    """The pickup stamp is read before the COMMIT is sent: no worker can see the message then,
    so no handler starts before the stamp and a latency cannot be negative."""
    seen: list[int] = []
    count = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(Message._meta.db_table))
    with psycopg.connect(database_url, autocommit=True) as other:  # where a worker looks

        def clock() -> float:
            seen.append(other.execute(count).fetchone()[0])  # type: ignore[index]
            return time.time()

        before = time.time()
        message_id, stamp = pickup.enqueue_stamped(connection.alias, clock)
        assert seen == [0]  # not committed when the clock was read
    assert before <= stamp <= time.time()
    assert Message.objects.filter(pk=message_id).exists()  # committed since


@pytest.mark.django_db(transaction=True)
def test_the_json_says_why_it_has_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a source archive or an installed package: no commit, and why."""
    if (ROOT / ".git").exists():
        assert set(runner.describe(connection.alias, sizes.TINY)["git"]) == {"commit", "dirty"}
    source = tmp_path / "source"
    source.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no higher
    monkeypatch.setattr(runner, "PACKAGE_ROOT", source)
    assert runner.describe(connection.alias, sizes.TINY)["git"] == {"error": "not a git checkout"}


def _e2e(channels: int, processes: int, threads: int, rate: float) -> E2EResult:
    return E2EResult(
        channels=channels,
        processes=processes,
        threads=threads,
        prefetch=0,
        batch=100,
        rate=rate,
        drain_rate=rate,
        backlog=1000,
        startup_s=1.0,
        drain_s=1.0,
        wall_s=3.0,
        failed=0,
        load1=0.1,
    )


def _fairness(a_backlog: int, processes: int, p99: float) -> FairnessResult:
    return FairnessResult(
        a_backlog=a_backlog,
        processes=processes,
        batch=10,
        burst=10,
        rounds=3,
        b_wait_p50_ms=p99 / 2,
        b_wait_p99_ms=p99,
        b_wait_max_ms=p99,
        a_before_b_max=10,
        claims_before_b_max=2,
        jain_min=1.0,
        a_rate=1000.0,
        a_left=5,
        load1=0.1,
    )


def test_e2e_marks_the_fastest_cell_of_each_channel_count() -> None:
    cells = [_e2e(1, 1, 8, 900), _e2e(1, 2, 32, 1200), _e2e(100, 1, 8, 800), _e2e(100, 2, 32, 700)]
    assert [c.best for c in e2e_finish(cells)] == [False, True, True, False]


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = {
        "e2e": e2e_finish([_e2e(100, 1, 8, 900), _e2e(100, 2, 32, 1500), _e2e(1, 1, 8, 1000)]),
        "fairness": [_fairness(10_000, 1, 12.0), _fairness(1_000_000, 1, 15.0)],
    }
    written = plots.write_plots(results, tmp_path / "img")
    assert [p.name for p in written] == [plots.E2E_FILE, plots.FAIRNESS_FILE]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG")
    assert plots.e2e_chart(results["e2e"]).xticks == {0.0: "1x8", 1.0: "2x32"}


def test_plots_without_matplotlib_fail_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(CommandError, match=r"django-fairqueue\[plots\]"):
        fairbench("--plots", "somewhere")


def _system(name: str, batch: float, e2e: float, p99: float | None) -> dict[str, Any]:
    return {
        "system": name,
        "concurrency_unit": "threads",
        "wakeup": "LISTEN/NOTIFY",
        "enqueue": [
            {"mode": "single", "processes": 2, "rate": batch / 20},
            {"mode": "batch", "processes": 2, "rate": batch},
        ],
        "e2e": [
            {
                "processes": 2,
                "concurrency": 32,
                "label": "2x32",
                "rate": e2e,
                "drain_rate": e2e,
                "backlog": 1000,
                "startup_s": 1.0,
                "best": True,
            },
        ],
        "pickup": {"p50_ms": 3.0, "p90_ms": 4.0, "p99_ms": 5.0, "max_ms": 6.0, "samples": 10},
        "fairness": [
            {
                "variant": "fair",
                "a_backlog": 10_000,
                "workers": "2x32",
                "b_p50_ms": p99,
                "b_p99_ms": p99,
                "a_before_b_max": 10,
                "jain_min": 1.0,
                "a_rate": 1000.0,
                "rounds": 5,
                "timed_out": 0,
            },
        ],
    }


def _ratio_row(text: str, system: str) -> list[str]:
    """A system's row of the enqueue ratios table, without its name."""
    table = text.split("Enqueue ratios", 1)[1].split("\n\n", 1)[0]
    rows = [line.split() for line in table.splitlines() if line.startswith(system + " ")]
    assert len(rows) == 1, table
    return rows[0][1:]


def test_comparison_goals_and_tables() -> None:
    """benchmarks/compare (run in its own tox env) reports its goals from the run's JSON."""
    from benchmarks.compare import report

    doc = {
        "systems": [
            _system("raw-sql", 60_000, 20_000, None),
            _system("django-fairqueue", 25_000, 4_000, 30.0),
            _system("procrastinate", 10_000, 1_500, 5_000.0),
        ]
    }
    doc["goals"] = goals = report.goals(doc)
    assert [(g["goal"], g["met"]) for g in goals] == [
        ("end-to-end >= 2x the fastest peer, while fair", True),
        ("enqueue batch >= 50% of the raw floor", False),
        ("enqueue one message, 2 proc, >= 0.6x the raw floor", False),
        ("enqueue one message, 2 proc, >= 1x the fastest peer", True),
        ("enqueue batch of 100, 2 proc, >= 1.2x the fastest peer", True),
        ("B's p99 < 50 ms with A's backlog 10,000", True),
    ]
    assert "2.67x" in goals[0]["measured"] and "42%" in goals[1]["measured"]
    text = report.tables(doc)
    assert "Goals" in text and "MISSED" in text
    # ratios to the floor and to the fastest other system (raw-sql aside), per process count
    assert _ratio_row(text, "django-fairqueue") == ["x2", "0.42", "0.42", "2.50", "2.50"]


def test_comparison_report_with_scenarios_left_out(tmp_path: Path) -> None:
    """``--scenario enqueue``: the other scenarios' lists are empty, ``pickup`` is None; the
    tables, goals and plots show what ran and skip the rest."""
    from benchmarks.compare import report, run

    assert run.parse_args([]).scenarios == list(run.SCENARIOS)
    assert run.SCENARIOS[:4] == ("enqueue", "e2e", "pickup", "fairness")
    chosen = run.parse_args(["--scenario", "pickup", "--scenario", "enqueue"]).scenarios
    assert chosen == ["enqueue", "pickup"]  # in running order
    doc: dict[str, Any] = {"systems": []}
    for name, rate in (("raw-sql", 60_000), ("django-fairqueue", 30_000), ("pgqueuer", 40_000)):
        system = _system(name, rate, 1.0, None)
        system.update(e2e=[], pickup=None, fairness=[], scenarios=["enqueue"])
        doc["systems"].append(system)
    doc["goals"] = goals = report.goals(doc)
    assert [g["goal"] for g in goals][:1] == ["enqueue batch >= 50% of the raw floor"]
    text = report.tables(doc)
    assert "Enqueue ratios" in text
    assert _ratio_row(text, "django-fairqueue") == ["x2", "0.50", "0.50", "0.75", "0.75"]
    assert _ratio_row(text, "pgqueuer") == ["x2", "0.67", "0.67", "1.33", "1.33"]
    assert "End-to-end" not in text and "Pickup" not in text and "Fairness" not in text
    assert "Heavy against light" not in text
    assert report.plots(doc, tmp_path) == []


def _cells(single: float, batch: float) -> list[dict[str, Any]]:
    return [
        {"mode": "single", "processes": 1, "rate": single},
        {"mode": "batch", "processes": 1, "rate": batch},
    ]


def test_enqueue_rounds_compare_systems_within_a_round() -> None:
    """With ``--rounds``, a ratio is taken between cells of the same round, then the median
    over rounds: a round where the machine was slow for everyone does not tilt it, and a
    round a system missed is left out of its ratios."""
    from benchmarks.compare import report, run

    floor_rounds = [_cells(4_000, 50_000), _cells(1_000, 20_000), _cells(3_000, 40_000)]
    ours_rounds = [_cells(2_800, 60_000), _cells(600, 30_000), None]
    peer_rounds = [_cells(2_000, 40_000), _cells(700, 30_000), _cells(2_000, 30_000)]
    systems = []
    for name, rounds in (
        ("raw-sql", floor_rounds),
        ("django-fairqueue", ours_rounds),
        ("pgqueuer", peer_rounds),
    ):
        systems.append(
            {
                "system": name,
                "enqueue_rounds": rounds,
                "enqueue": run.median_cells(rounds),
                "e2e": [],
                "pickup": None,
                "fairness": [],
            }
        )
    ours = systems[1]
    assert run.median_cells(ours_rounds) == [
        {"mode": "single", "processes": 1, "rate": 1_700.0, "rounds": 2},
        {"mode": "batch", "processes": 1, "rate": 45_000.0, "rounds": 2},
    ]
    assert report.enqueue_ratios(ours, [systems[0]], "single", 1) == [0.7, 0.6]
    assert report.enqueue_ratios(ours, [systems[2]], "single", 1) == [1.4, 600 / 700]
    goals = {g["goal"]: g for g in report.goals({"systems": systems})}
    floor_goal = goals["enqueue one message, 1 proc, >= 0.6x the raw floor"]
    assert floor_goal["met"] and floor_goal["measured"] == "0.65 (0.60-0.70)x over 2 round(s)"
    assert goals["enqueue batch of 100, 1 proc, >= 1.2x the fastest peer"]["met"] is True
    text = report.tables({"systems": systems})
    assert "median of 3 rounds (range)" in text
    assert _ratio_row(text, "django-fairqueue")[:2] == ["x1", "0.65"]


def _compare_e2e(label: str, rate: float) -> dict[str, Any]:
    processes, concurrency = (int(v) for v in label.split("x"))
    return {
        "label": label,
        "processes": processes,
        "concurrency": concurrency,
        "prefetch": 0,
        "rate": rate,
        "drain_rate": rate,
        "startup_s": 1.0,
        "backlog": 3_000,
        "best": False,
    }


def test_a_baseline_alternates_with_this_checkout_end_to_end_and_at_pickup() -> None:
    """``--baseline REF`` with the end-to-end and pickup scenarios runs them in rounds, the
    baseline and this checkout alternating: each configuration's rate is the median over the
    rounds, its ratio to the baseline is taken within each round, and the pickup samples of
    every round are pooled. ``--config`` names the sweep."""
    from benchmarks.compare import report, run
    from benchmarks.compare.common import WorkerConfig

    args = run.parse_args(
        [
            *("--scenario", "e2e", "--scenario", "pickup", "--baseline", "58637c5"),
            *("--config", "1x1", "--config", "1x32+64", "--rounds", "3"),
        ]
    )
    assert args.configs == [WorkerConfig(1, 1), WorkerConfig(1, 32, prefetch=64)]
    assert [c.label for c in args.configs] == ["1x1", "1x32+64"]  # what the child is told
    for wrong in ("1x", "x4", "0x4", "1x4+", "2x4-1"):
        with pytest.raises(SystemExit):
            run.parse_args(["--config", wrong])

    def rounds(rates: list[tuple[float, float]], pickups: list[list[float]]) -> list[Any]:
        return [
            {
                "scenarios": ["e2e", "pickup"],
                "enqueue": [],
                "e2e": [_compare_e2e("1x1", one), _compare_e2e("1x4", four)],
                "pickup": {"latencies_ms": latencies, "p99_ms": max(latencies)},
            }
            for (one, four), latencies in zip(rates, pickups, strict=True)
        ]

    # the third round ran on a machine twice as busy for both: the ratios hold
    ours = rounds([(500, 1_500), (520, 1_400), (250, 800)], [[2.0, 3.0], [4.0], [1.0, 9.0]])
    theirs = rounds([(400, 1_500), (400, 1_000), (200, 800)], [[5.0], [6.0, 7.0], [8.0]])
    theirs[1] = None  # a round the baseline failed is left out of the ratios
    systems = []
    for name, found in (("django-fairqueue", ours), ("django-fairqueue-baseline", theirs)):
        result = {"system": name, "version": name, "scenarios": [], "pickup": None}
        result.update(concurrency_unit="threads", wakeup="LISTEN/NOTIFY")
        run.merge_rounds(result, found)
        systems.append(result)
    us, before = systems
    assert us["scenarios"] == ["e2e", "pickup"]
    assert [(c["label"], c["rate"], c["rounds"], c["best"]) for c in us["e2e"]] == [
        ("1x1", 500, 3, False),
        ("1x4", 1_400, 3, True),
    ]
    assert [c["rate"] for c in before["e2e"]] == [300, 1_150]
    assert report.e2e_ratios(us, before, "1x1") == [1.25, 1.25]
    assert report.e2e_ratios(us, before, "1x4") == [1.0, 1.0]
    assert us["pickup"]["samples"] == 5 and us["pickup"]["rounds"] == 3
    assert us["pickup"]["max_ms"] == 9.0 and us["pickup"]["p50_ms"] == 3.0
    assert before["pickup"]["samples"] == 2  # the failed round had none

    text = report.tables({"systems": systems})
    title = "End to end, django-fairqueue over django-fairqueue-baseline"
    assert title in text
    rows = [line.split() for line in text.split(title)[1].splitlines() if line.startswith("1x")]
    assert rows == [
        ["1x1", "500", "300", "1.25", "(1.25-1.25)", "3"],
        ["1x4", "1,400", "1,150", "1.00", "(1.00-1.00)", "3"],
    ]
    assert "Pickup, django-fairqueue and django-fairqueue-baseline" in text


@pytest.mark.slow
def test_a_baseline_from_before_the_database_layer_runs_end_to_end(
    tmp_path: Path, database_url: str
) -> None:
    """``--baseline 58637c5`` (the claim before groups, queues and fairness by time: one store
    module, the bench app under another name) drains a tiny backlog through its own workers
    beside this checkout's, each importing only its own package."""
    from benchmarks.compare import run

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "58637c5^{commit}"],
        capture_output=True,
        check=False,
    )
    if commit.returncode != 0:
        pytest.skip("not a git checkout with that commit")
    path = tmp_path / "compare.json"
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.compare.run", "--sizes", "tiny", "--rounds", "2"),
            *("--system", "django-fairqueue", "--baseline", "58637c5", "--db-prefix", "cbase_"),
            *("--scenario", "e2e", "--scenario", "pickup", "--config", "1x2", "--json", str(path)),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "failed" not in result.stderr, result.stderr
    systems = {s["system"]: s for s in json.loads(path.read_text())["systems"]}
    assert set(systems) == {"django-fairqueue", run.BASELINE}
    for system in systems.values():
        assert [len(cells or []) for cells in system["e2e_rounds"]] == [1, 1]
        assert system["e2e"][0]["label"] == "1x2" and system["e2e"][0]["rate"] > 0
        assert len(system["pickup_rounds"]) == 2 and system["pickup"]["samples"] > 0
    assert systems[run.BASELINE]["version"].endswith("at 58637c5")
    assert "End to end, django-fairqueue over django-fairqueue-baseline" in result.stdout


@pytest.mark.django_db(transaction=True)
def test_the_old_snapshot_holds_back_the_xmin_horizon_until_its_block_ends() -> None:
    with db.hold_old_snapshot() as pid:
        assert db.select_backend_holds_xmin(pid)
        held = connection.cursor()
        held.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid])
        assert held.fetchone() == ("idle in transaction",)
    # Closing sends Terminate; the server ends the session (and the snapshot) just after.
    deadline = time.monotonic() + 10
    while db.select_backend_holds_xmin(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not db.select_backend_holds_xmin(pid)


@pytest.mark.django_db(transaction=True)
def test_a_scenario_that_cannot_run_here_is_skipped_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db import DatabaseError

    from django_fairqueue.contrib.bench import functions, runner

    assert functions.unavailable(connection.alias) is None  # the test server: a superuser

    def refused(**_: Any) -> None:
        raise DatabaseError('permission denied to set parameter "track_functions"')

    monkeypatch.setattr(db, "enable_function_timing", refused)
    reason = functions.unavailable(connection.alias)
    assert reason is not None and "track_functions" in reason

    report = runner.run(
        [SCENARIOS["functions"], SCENARIOS["snapshot"]], sizes.TINY, using=connection.alias
    )
    assert list(report.scenarios) == ["snapshot"]  # the other scenario still ran
    assert any(w.startswith("scenario functions skipped: needs") for w in report.meta["warnings"])


def test_a_baseline_is_compared_with_but_is_no_peer() -> None:
    """``--baseline REF`` runs django-fairqueue as it was at REF in the same enqueue rounds:
    its own table says how this checkout compares with it, round by round, and it is never
    the "fastest peer" the goals are judged against (nor are the peers judged against it)."""
    from benchmarks.compare import report, run

    assert run.parse_args(["--scenario", "enqueue", "--baseline", "main"]).baseline == "main"
    with pytest.raises(SystemExit):
        run.parse_args(["--baseline", "main"])  # every scenario: refused
    with pytest.raises(SystemExit):  # the fairness scenarios configure what REF may lack
        run.parse_args(["--scenario", "e2e", "--scenario", "sybil", "--baseline", "main"])
    rounds = {
        "raw-sql": [_cells(4_000, 50_000), _cells(2_000, 40_000)],
        "django-fairqueue": [_cells(2_200, 60_000), _cells(1_300, 48_000)],
        "pgqueuer": [_cells(2_000, 50_000), _cells(1_200, 40_000)],
        # faster than pgqueuer: were it a peer, the goals would be judged against it
        "django-fairqueue-baseline": [_cells(2_100, 55_000), _cells(1_250, 44_000)],
    }
    systems = [
        {
            "system": name,
            "version": name,
            "enqueue_rounds": cells,
            "enqueue": run.median_cells(cells),
            "e2e": [],
            "pickup": None,
            "fairness": [],
        }
        for name, cells in rounds.items()
    ]
    goals = {g["goal"]: g for g in report.goals({"systems": systems})}
    peer_goal = goals["enqueue one message, 1 proc, >= 1x the fastest peer"]
    assert peer_goal["measured"] == f"{(1.1 + 1300 / 1200) / 2:.2f} (1.08-1.10)x over 2 round(s)"
    text = report.tables({"systems": systems})
    # pgqueuer's fastest other system is django-fairqueue, not its baseline
    # (each ratio is "median (range)": the single/peer column is the 6th and 7th words)
    assert _ratio_row(text, "pgqueuer")[5:7] == ["0.92", "(0.91-0.92)"]
    # the baseline itself is compared with the peers alone
    assert _ratio_row(text, "django-fairqueue-baseline")[5:7] == ["1.05", "(1.04-1.05)"]
    after = [line.split() for line in text.splitlines() if line.startswith("x1 ")]
    assert after == [["x1", "1.04", "(1.04-1.05)", "1.09", "(1.09-1.09)"]]


def test_the_sybil_target_judges_the_grouped_cells_only() -> None:
    from django_fairqueue.contrib.bench import groups
    from django_fairqueue.contrib.bench.report import Report, ScenarioReport, check_targets

    def cell(grouped: bool, p99: float) -> groups.SybilResult:
        return groups.SybilResult(10_000, grouped, 20, 5.0, p99, p99, 10.0, 0.1)

    def verdict(*cells: groups.SybilResult) -> list[tuple[str, bool]]:
        report = Report(meta={}, scenarios={"sybil": ScenarioReport(groups.SYBIL, list(cells))})
        return [(c.measured, c.met) for c in check_targets(report)]

    # as 101 channels bob gets 100 turns to alice's one: only the grouped cells are judged
    assert verdict(cell(True, 12.5), cell(False, 240.0)) == [
        ("12.5 ms (bob's backlog 10,000 in 100 channels)", True)
    ]
    assert verdict(cell(True, 50.1)) == [("50.1 ms (bob's backlog 10,000 in 100 channels)", False)]
    assert verdict(cell(False, 1.0)) == []


def test_a_stop_signal_that_lands_in_a_commit_still_reads_as_a_stop() -> None:
    """The signal's exception raised inside Django's COMMIT leaves the connection in its
    transaction, and the atomic block's way out fails on that: the run still ends as stopped."""
    from django_fairqueue.contrib.bench.management.commands import fairbench as command

    def commit_interrupted() -> None:
        try:
            raise command.Stopped(signal.SIGINT)
        except command.Stopped as stopped:
            raise DatabaseError("can't change 'autocommit' now") from stopped

    cmd = command.Command(stderr=StringIO())
    cmd._handle = lambda options: commit_interrupted()  # type: ignore[method-assign]
    with pytest.raises(SystemExit) as exit_:
        cmd.handle()
    assert exit_.value.code == 128 + signal.SIGINT
    assert cmd.stderr.getvalue().strip() == "fairbench: run stopped by SIGINT"

    def other_error() -> None:
        raise DatabaseError("no")

    cmd._handle = lambda options: other_error()  # type: ignore[method-assign]
    with pytest.raises(DatabaseError, match="no"):
        cmd.handle()


@pytest.mark.django_db(transaction=True)
def test_the_fairness_cost_script_compares_both_modes_on_the_same_traffic(capsys: Any) -> None:
    """benchmarks/fairness_cost.py, small: both modes claim full batches in turn and their
    CPU per claim, ratio and per-block ratios are printed."""
    from benchmarks import fairness_cost

    out = fairness_cost.main(cycles=((1, 8), (5, 4)), blocks=2, backlog=100)
    assert set(out) == {1, 5}
    for batch, figures in out.items():
        assert figures["claims"] == (8 if batch == 1 else 4)
        assert len(figures["per_block"]) == 2
        assert figures["by_count_cpu_us"] >= 0 and figures["by_time_cpu_us"] >= 0
    assert capsys.readouterr().out.startswith("fairness_cost {")
    assert not Message.objects.exists()  # it empties what it loaded


@pytest.mark.django_db(transaction=True)
def test_the_idle_poll_script_prints_the_cpu_of_polls_that_find_nothing(capsys: Any) -> None:
    from benchmarks import idle_poll

    out = idle_poll.main(polls=20)
    assert set(out) == {"server_cpu_us_per_poll", "wall_us_per_poll"}
    assert out["wall_us_per_poll"] > 0
    assert capsys.readouterr().out.startswith("idle_poll {")
