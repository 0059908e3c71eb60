"""``manage.py fairbench``: the queue's benchmark, as an optional app (docs/performance.md).

Add ``"django_fairqueue.contrib.bench"`` to ``INSTALLED_APPS`` (beside ``"django_fairqueue"``)
to get the command. The app has no models and no migrations; its SQL is ``sql/bench.sql``,
run by ``db.py``. The scenarios are listed in ``scenarios.py``.

This module imports nothing: Django imports it while the app registry is still loading.
"""
