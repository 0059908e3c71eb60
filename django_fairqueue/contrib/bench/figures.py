"""Summary figures the benchmarks print: percentiles and Jain's fairness index.

Free of Django, so the peer comparison (``benchmarks/compare``) uses it in processes that never
configure Django, as fairbench (``django_fairqueue.contrib.bench``) does in its own. (The admin's
figures come from histograms and maintained counters instead: ``django_fairqueue.stats``.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def spread_pct(runs: Sequence[float], middle: float) -> float | None:
    """(the largest - the smallest of ``runs``) / ``middle`` (their median), in %: how far
    repeated runs of one cell (``--repeat``) fell apart; None after a single run."""
    if len(runs) < 2 or not middle:
        return None
    return 100 * (max(runs) - min(runs)) / middle


def jain_index(shares: Sequence[float]) -> float:
    """Jain's fairness index of ``shares``: (sum x)^2 / (n * sum x^2), from 1/n to 1; 1.0 when
    nothing was shared out."""
    squares = sum(x * x for x in shares)
    if not squares:
        return 1.0
    return sum(shares) ** 2 / (len(shares) * squares)


def fair_completion_times(
    workers: float,
    jobs: Mapping[str, tuple[float, float, float]],
    background: bool = False,
) -> dict[str, float]:
    """Each tenant's completion time under the ideal fair schedule (processor sharing).

    ``jobs`` maps a tenant to (arrival, seconds of work, most workers it can use at once: its
    number of jobs). At every instant the ``workers`` are split equally among the tenants with
    work left, a tenant never getting more than it can use, what it cannot use going to the
    others (water-filling); with ``background``, one more tenant that always has work and can
    use any number of workers takes its equal share too. Returns tenant -> completion time, on
    the arrivals' clock. A job of d seconds never completes in less than d: a tenant of n jobs
    of d seconds can use n workers, so its n x d seconds of work take at least d."""
    left = {k: work for k, (_, work, _) in jobs.items()}
    arrivals = sorted((a, k) for k, (a, _, _) in jobs.items())
    now = arrivals[0][0] if arrivals else 0.0
    active: set[str] = set()
    done: dict[str, float] = {}
    i = 0
    while len(done) < len(jobs):
        while i < len(arrivals) and arrivals[i][0] <= now + 1e-12:
            active.add(arrivals[i][1])
            i += 1
        if not active:
            now = arrivals[i][0]
            continue
        # water-filling: the tenants that cannot use an equal share get what they can use
        rate: dict[str, float] = {}
        capacity, claimants = float(workers), len(active) + (1 if background else 0)
        for k in sorted(active, key=lambda k: jobs[k][2]):
            share = capacity / claimants
            rate[k] = min(share, jobs[k][2])
            capacity -= rate[k]
            claimants -= 1
        finish_in = min(left[k] / rate[k] for k in active)
        next_arrival = arrivals[i][0] - now if i < len(arrivals) else math.inf
        step = min(finish_in, next_arrival)
        for k in list(active):
            left[k] -= rate[k] * step
            if left[k] <= 1e-9:
                done[k] = now + step
                active.discard(k)
        now += step
    return done
