"""Summary figures the benchmarks print: percentiles and Jain's fairness index.

Free of Django, so the peer comparison (``benchmarks/compare``) uses it in processes that never
configure Django, as fairbench (``django_fairqueue.contrib.bench``) does in its own. (The admin's
figures come from histograms and maintained counters instead: ``django_fairqueue.stats``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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


def jain_index(shares: Sequence[float]) -> float:
    """Jain's fairness index of ``shares``: (sum x)^2 / (n * sum x^2), from 1/n to 1; 1.0 when
    nothing was shared out."""
    squares = sum(x * x for x in shares)
    if not squares:
        return 1.0
    return sum(shares) ** 2 / (len(shares) * squares)
