"""The only code that runs queue SQL: one module per table family.

===================  ========================  ================================================
module               statements                what it runs
===================  ========================  ================================================
``pg``               ``statements/pg.sql``     the kept cursor, ``run_statement``,
                                               statement files, a connection of its own,
                                               lock-timeout detection, the database clock
``enqueue_store``    ``enqueue.sql``           inserting messages
``message_store``    ``messages.sql``          claim, heartbeat, settle, rescue; cancel, abort,
                                               retry, delete, purge, prune
``channel_store``    ``channels.sql``          channels and channel groups: creation, name
                                               locks, counters, limits, scheduler state
``stats_store``      ``statistics.sql``        per-channel and per-minute statistics
``integrity_store``  ``integrity.sql``         the integrity recount: verify counters, unique
                                               holds and orphans, repair them
``batch_store``      ``work_batches.sql``      work batches: planning, claim, settlement
``worker_store``     ``workers.sql``           the worker registry
``schedule_store``   ``schedules.sql``         periodic schedules: due schedules, slots, fires
===================  ========================  ================================================

The server functions the statements call live in ``functions/``, one ``.sql`` file per family,
with their loader (:mod:`django_fairqueue.db.functions`); migrations install them from there.

Each module has one function per named statement of its file in ``statements/``
(``-- name: verb_noun`` and a one-line description; tests/test_store_sql.py checks both ways)
and returns plain values or small frozen dataclasses. Worker, API, admin actions and the
optional apps call these, never SQL of their own; a module uses another's public functions
only (tests/test_db_imports.py). Callers import the module of the family,
``from django_fairqueue.db import message_store``: the names say which family a call touches
and stay clear of the variables callers name ``messages`` or ``channels``.
"""
