"""Django signals of the queue: a message was enqueued, started, finished.

Every signal is sent with ``sender=django_fairqueue.models.Message`` (the class, so a receiver
can be connected with ``sender=Message``) and keyword arguments only:

``message_enqueued``
    Sent by :func:`django_fairqueue.enqueue` / :func:`~django_fairqueue.enqueue_many` after the
    messages were inserted, on the caller's connection and *inside the caller's transaction*:
    if that transaction rolls back, the messages never existed. A receiver that must only act
    on committed messages wraps its work in ``transaction.on_commit``. Only sent when a receiver
    is connected (building the arguments costs nothing otherwise).

    * ``message_ids`` (``list[int]``): the messages' ids, in the order they were enqueued, each
      once (requests of one call sharing a unique key stored one message). An enqueue that met
      a key a message held before the call (kept or replaced) reports that message's id like a
      new one. One that raises sends nothing;
    * ``channels`` (``list[str]``): each message's channel name (within its queue, as enqueue
      was given it), parallel to ``message_ids``;
    * ``queues`` (``list[str]``): each message's queue, parallel to ``message_ids``.

``message_started``
    Sent by the worker in the handler thread, right before it calls the task function.

    * ``message`` (:class:`django_fairqueue.db.message_store.ClaimedMessage`): id, channel (the name
      within its queue), queue, task name, payload, attempt number (``attempts``, counting this
      one), lease;
    * ``worker_id`` (``str``): the worker process's id (``host:pid:random``).

``message_finished``
    Sent by the worker in the handler thread once the task returned or raised (before the
    outcome is written to the database, which happens in batches).

    * ``message`` (``ClaimedMessage``) and ``worker_id`` (``str``): as above;
    * ``outcome`` (``str``): ``"succeeded"``; ``"retry"`` (it raised and will run again);
      ``"failed"`` (it raised with no attempt left, or could not run at all); ``"released"``
      (it raised because the database was unavailable: given back to run again shortly,
      the attempt not counted; ``error["unavailable"]`` names the cause); ``"aborted"`` (its
      abort was requested: it stopped, or had not started; see docs/howto/cancel-abort.md);
    * ``duration`` (``float``): seconds the attempt took;
    * ``error`` (``dict | None``): the stored error (``type``, ``message``, ``traceback``) when
      the outcome is not ``"succeeded"``.

Receivers run synchronously in the sending thread: keep them short (a slow receiver of
``message_finished`` holds a handler slot). An exception in a receiver propagates to the sender
as with any ``Signal.send``; the worker sends with ``send_robust`` and logs receiver errors
instead, so a broken receiver cannot fail a message.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = ["message_enqueued", "message_finished", "message_started"]

message_enqueued = Signal()
message_started = Signal()
message_finished = Signal()
