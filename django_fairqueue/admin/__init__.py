"""The admin: tenants (channels) to see and steer, messages and work batches to act on, and a
dashboard. One module per page family:

* :mod:`~django_fairqueue.admin.channels`: the per-tenant table (docs/howto/admin.md explains
  each column), editable limits, actions (pause, resume, retry failed, purge backlog with a
  confirmation page), and the **dashboard** at ``<admin>/fairqueue/channel/dashboard/``
  (charts drawn in the browser, refreshed from a JSON endpoint next to it). The list stays
  fast with many channels: the page's counts come from the counters plus pending deltas in a
  few queries for the whole page (:mod:`django_fairqueue.observe.overview`), never a COUNT(*)
  of messages per row.
* :mod:`~django_fairqueue.admin.groups`: channel groups and their limits.
* :mod:`~django_fairqueue.admin.messages` and :mod:`~django_fairqueue.admin.batches`:
  read-only; their actions (retry, cancel, delete) go through :mod:`django_fairqueue.db`, like
  the Python API, so counters stay exact. The message list at a million rows is
  :mod:`~django_fairqueue.admin.lists` (estimated counts, keyset paging).
* :mod:`~django_fairqueue.admin.schedules`: periodic schedules, with their next fire time; a
  channel's page lists its own.
* :mod:`~django_fairqueue.admin.usage`: worker time, attempts and failures per channel or
  group over a range of days, sortable, as CSV too.
* :mod:`~django_fairqueue.admin.workers`: the worker registry, and what each worker runs now.

What the pages share is in :mod:`~django_fairqueue.admin.common`.

Permissions: viewing needs the model's view (or change) permission, as usual. Editing a
channel, pause, resume and retry need *change channel*; purge also needs *delete message*.
Message retry and cancel need *change message*, message delete needs *delete message*; work
batch retry needs *change work batch*. Channels and messages are never deleted through the
ORM here (that would bypass the counters). Every action writes admin log entries.
"""

from __future__ import annotations

from django_fairqueue.admin.batches import WorkBatchAdmin
from django_fairqueue.admin.channels import ChannelAdmin
from django_fairqueue.admin.groups import ChannelGroupAdmin
from django_fairqueue.admin.messages import MessageAdmin
from django_fairqueue.admin.schedules import ScheduleAdmin
from django_fairqueue.admin.usage import UsageAdmin
from django_fairqueue.admin.workers import WorkerAdmin

__all__ = [
    "ChannelAdmin",
    "ChannelGroupAdmin",
    "MessageAdmin",
    "ScheduleAdmin",
    "UsageAdmin",
    "WorkBatchAdmin",
    "WorkerAdmin",
]
