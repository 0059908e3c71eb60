"""How big each scenario is: the full run, ``--quick`` and the tiny sizes the tests use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    name: str
    #: Seconds each throughput cell (enqueue, claim+complete) is measured.
    duration: float
    #: Each throughput cell runs this many times; the table shows the median.
    repeat: int = 1
    # -- enqueue --
    enqueue_processes: tuple[int, ...] = (1, 2)
    enqueue_channels: int = 100
    # -- claim + complete --
    claim_channels: tuple[int, ...] = (1, 100)
    claim_batches: tuple[int, ...] = (1, 100)
    claimers: tuple[int, ...] = (1, 2, 4)
    #: Seconds of the single-claimer probe that sizes each cell's pre-fill.
    calibration: float = 1.0
    #: Most messages pre-filled for one cell (a faster cell stops early when it runs dry).
    max_fill: int = 3_000_000
    # -- claim latency --
    latency_backlogs: tuple[int, ...] = (1_000, 100_000, 1_000_000)
    latency_backlog_channels: int = 100
    latency_channel_counts: tuple[int, ...] = (10, 10_000)
    latency_channel_backlog: int = 100_000
    latency_batch: int = 100
    latency_samples: int = 300
    latency_warmup: int = 20
    # -- fairness --
    #: B's wait with A's backlog at 10,000 and at 1,000,000 (100,000 between them).
    fairness_backlogs: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    fairness_processes: tuple[int, ...] = (1, 2)
    fairness_batch: int = 10
    fairness_burst: int = 10
    #: B enqueues its burst this many times per cell (more samples for p99).
    fairness_rounds: int = 5
    #: Seconds the claimers run on A's backlog before B's first burst, and between bursts.
    fairness_pause: float = 0.1
    # -- periodic schedules: a firing pass --
    schedules_counts: tuple[int, ...] = (100, 10_000)
    schedules_due: tuple[int, ...] = (0, 1, 100)
    schedules_samples: int = 30
    # -- claims under an old snapshot (a long transaction elsewhere) --
    snapshot_channels: int = 20
    snapshot_backlog: int = 2_000
    #: Cycles (enqueue 1, claim 1, complete) run while the snapshot is held, one cell each.
    snapshot_cycles: tuple[int, ...] = (0, 5_000, 10_000)
    snapshot_samples: int = 200
    # -- server time inside the claim's functions --
    functions_batches: tuple[int, ...] = (1, 100)
    functions_backlog: int = 100_000
    #: calls of the empty claim; the backlog cells make half as many
    functions_samples: int = 4_000
    # -- channel groups: claim cost by channels and groups, and the sybil tenant --
    #: (channels, groups) per cell, 0 groups: ungrouped; the first is each batch's reference
    groups_cells: tuple[tuple[int, int], ...] = (
        (10, 0),
        (10_000, 0),
        (10, 1),
        (10_000, 1),
        (10_000, 10),
        (10_000, 100),
        (10_000, 1_000),
    )
    groups_per_channel: int = 10
    groups_samples: int = 1_000
    #: bob's backlog (over his 100 channels) while alice's bursts wait
    sybil_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    # -- end to end (real runfairworker processes) --
    e2e_channels: tuple[int, ...] = (1, 100)
    #: The sweep of worker processes x handler threads x prefetch; the best
    #: cell is marked. Prefetch lets one claim fill the threads and queue more behind them.
    e2e_workers: tuple[tuple[int, int, int], ...] = (
        (1, 1, 0),
        (2, 1, 0),  # 2 processes x 1, 2, 4 threads
        (2, 2, 0),
        (2, 4, 0),
        (1, 8, 0),
        (2, 16, 0),
        (2, 32, 0),
        (2, 64, 0),
        (2, 100, 0),
        (2, 32, 68),
        (2, 64, 136),
    )
    e2e_batch: int = 100
    #: Backlog bounds of one cell; within them it is sized to drain in about ``duration``.
    e2e_min_backlog: int = 2_000
    e2e_max_backlog: int = 300_000
    #: Rate (tasks/s) assumed for the first cell of each channel count.
    e2e_first_guess: float = 500.0
    # -- pickup latency (one idle runfairworker process) --
    pickup_modes: tuple[str, ...] = ("listen", "poll")
    pickup_samples: int = 200
    #: Samples of the polling cell (each takes about a poll interval).
    pickup_poll_samples: int = 40
    pickup_warmup: int = 5
    #: Least seconds between a message's completion and the next enqueue: longer than the
    #: worker's quick re-claims after an empty claim (10 ms, doubling), so every
    #: message finds the worker idle. A random part is added (up to this again, or up to the
    #: poll interval when polling).
    pickup_pause: float = 0.1
    pickup_poll_interval: float = 1.0
    # -- admin pages (``--messages`` / ``--channels`` override the first two) --
    admin_messages: int = 1_000_000
    admin_channels: int = 10_000
    #: Timed requests per page (after one warm-up); the table shows their median.
    admin_samples: int = 5
    # -- fairness by count and by time (timeshare) --
    timeshare_workloads: tuple[str, ...] = ("flood", "sybil", "heavy", "weights", "bursts")
    #: Every workload at the first backlog; only these at the larger ones as well.
    timeshare_backlogs: tuple[int, ...] = (10_000, 1_000_000)
    timeshare_big_workloads: tuple[str, ...] = ("flood", "sybil", "heavy", "weights", "bursts")
    timeshare_workers: int = 4
    #: Seconds the heavy and weights workloads run; the bursts arrive within 0.6 of it.
    timeshare_window: float = 15.0
    timeshare_tenants: int = 50
    timeshare_burst_max: int = 40


FULL = Sizes(name="full", duration=5.0)

QUICK = Sizes(
    name="quick",
    duration=1.5,
    calibration=0.5,
    max_fill=1_000_000,
    latency_samples=100,
    latency_warmup=10,
    fairness_backlogs=(10_000, 100_000),
    fairness_rounds=3,
    snapshot_cycles=(0, 2_000, 5_000),
    snapshot_samples=100,
    schedules_samples=20,
    functions_samples=1_000,
    groups_samples=300,
    sybil_backlogs=(10_000,),
    e2e_workers=((1, 8, 0), (2, 32, 0), (2, 64, 0), (2, 32, 68)),
    e2e_min_backlog=1_000,
    pickup_samples=100,
    pickup_poll_samples=15,
    admin_messages=200_000,
    admin_samples=3,
    timeshare_backlogs=(10_000,),
)

#: For tests: every scenario and code path in seconds, figures meaningless.
TINY = Sizes(
    name="tiny",
    duration=0.3,
    enqueue_processes=(1, 2),
    enqueue_channels=3,
    claim_channels=(1, 3),
    claim_batches=(1, 10),
    claimers=(1, 2),
    calibration=0.2,
    max_fill=20_000,
    latency_backlogs=(100, 1_000),
    latency_backlog_channels=5,
    latency_channel_counts=(2, 20),
    latency_channel_backlog=1_000,
    latency_batch=10,
    latency_samples=5,
    latency_warmup=2,
    fairness_backlogs=(300,),
    fairness_processes=(1, 2),
    fairness_batch=10,
    fairness_burst=3,
    fairness_rounds=2,
    fairness_pause=0.02,
    snapshot_channels=3,
    snapshot_backlog=30,
    snapshot_cycles=(0, 20),
    snapshot_samples=5,
    schedules_counts=(10,),
    schedules_due=(0, 2),
    schedules_samples=3,
    functions_batches=(1, 10),
    functions_backlog=1_000,
    functions_samples=20,
    groups_cells=((4, 0), (20, 0), (20, 2)),
    groups_per_channel=5,
    groups_samples=10,
    sybil_backlogs=(300,),
    e2e_channels=(3,),
    e2e_workers=((1, 2, 4),),
    e2e_min_backlog=300,
    e2e_max_backlog=300,
    pickup_modes=("listen",),
    pickup_samples=10,
    pickup_poll_samples=3,
    pickup_warmup=2,
    pickup_pause=0.07,
    admin_messages=3_000,
    admin_channels=30,
    admin_samples=1,
    timeshare_backlogs=(300,),
    timeshare_workers=2,
    timeshare_window=1.0,
    timeshare_tenants=4,
    timeshare_burst_max=3,
)

PRESETS = {s.name: s for s in (FULL, QUICK, TINY)}
