"""Bounds of names and channel limits, shared by the models, the settings and the API.

A module of constants only (no Django import), so that settings validation (``conf``) and the
task registry need not import the models.
"""

from __future__ import annotations

from datetime import timedelta

#: Longest channel name accepted (characters). Names are identifiers, not documents.
CHANNEL_NAME_MAX_LENGTH = 200
#: Longest queue name accepted (characters); see django_fairqueue.queues.
QUEUE_NAME_MAX_LENGTH = 64
#: Longest channel group name accepted (characters); a group name has no '/'.
GROUP_NAME_MAX_LENGTH = 100
#: Upper bounds that catch typos (a weight of 1e9 is a mistake, not a policy).
MAX_WEIGHT = 1000
MAX_CONCURRENCY_LIMIT = 1_000_000
MAX_RELEASE_INTERVAL = timedelta(days=1)
TASK_NAME_MAX_LENGTH = 200
#: Longest unique key accepted (characters), as channel names.
UNIQUE_KEY_MAX_LENGTH = 200
#: A message's priority range: django.tasks' own, so a task moves between backends unchanged.
MIN_PRIORITY = -100
MAX_PRIORITY = 100


def priority_error(priority: object) -> str | None:
    """Why ``priority`` is not a message priority, or None when it is one."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"priority must be an integer, got {priority!r}"
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        return f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}"
    return None
