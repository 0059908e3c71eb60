"""Tables of django-fairqueue, a module per family: ``channels``, ``messages``, ``stats``,
``batches``, ``workers`` and ``schedules``; import them from here.

The models own the DDL (tables, named partial indexes, CHECK constraints), so ``makemigrations`` is
the single source of truth for the schema. Every statement that *moves* queue state lives in
``db/statements/`` and the server functions (``db/functions/``) and is run by
``django_fairqueue.db``; nothing here writes queue state through the ORM.

How the pieces fit (see docs/explanation/fairness.md):

* ``Channel`` is a tenant's virtual queue. Its model maps the name and the limits operators
  edit; the scheduler's state (counters and turns) shares the row but is written only by the
  SQL functions and is not a model field (see the class docstring). ``next_turn_at`` is both
  the earliest moment the channel may release again (rate limit) and its place in the
  round-robin: serving a channel moves it to the back by setting ``next_turn_at`` to the
  claim time.
* ``Message`` rows are the work. Only the claim, complete/fail/release and the rescuer change
  their state.
* ``ChannelDelta`` rows are counter changes written by everything *except* the claims
  (enqueue, complete, fail, rescue, admin actions, work-batch settlements). The claims fold
  them into the channel row. This keeps enqueue and completion from ever locking a channel
  row, so a view's long transaction cannot stall workers.
"""

from django_fairqueue.models.batches import BatchState, WorkBatch
from django_fairqueue.models.channels import Channel, ChannelGroup
from django_fairqueue.models.messages import (
    UNIQUE_HELD_STATES,
    ChannelDelta,
    Message,
    MessageState,
    UniqueHold,
    UniqueScope,
)
from django_fairqueue.models.schedules import MissedPolicy, Schedule, ScheduleFire, ScheduleSource
from django_fairqueue.models.stats import (
    ERROR_HISTORY,
    WAIT_BUCKETS_MS,
    ChannelStat,
    IntegerArrayField,
    MinuteStat,
    UsageHour,
    UsageTotal,
)
from django_fairqueue.models.workers import WorkerRecord, WorkerState

__all__ = [
    "ERROR_HISTORY",
    "UNIQUE_HELD_STATES",
    "WAIT_BUCKETS_MS",
    "BatchState",
    "Channel",
    "ChannelDelta",
    "ChannelGroup",
    "ChannelStat",
    "IntegerArrayField",
    "Message",
    "MessageState",
    "MinuteStat",
    "MissedPolicy",
    "Schedule",
    "ScheduleFire",
    "ScheduleSource",
    "UniqueHold",
    "UniqueScope",
    "UsageHour",
    "UsageTotal",
    "WorkBatch",
    "WorkerRecord",
    "WorkerState",
]
