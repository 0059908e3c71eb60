"""What the worker is running right now, for code that needs it (the django.tasks backend).

The worker sets :data:`current_message` around each handler call; it is ``None`` elsewhere.
A context variable, so each worker thread sees its own message.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_fairqueue.store import ClaimedMessage

current_message: ContextVar[ClaimedMessage | None] = ContextVar(
    "fairqueue_current_message", default=None
)
