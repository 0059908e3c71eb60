"""The SQL a migration installs, read from its own frozen copy under ``migrations/sql/``.

A migration must install the same thing forever, so it never reads the live files in
``django_fairqueue/sql/`` (which change with the code): each migration that installs
server-side functions reads ``migrations/sql/<migration name>.sql``, a copy of the live file as
it stood when that migration was the latest. These copies are never edited. To change a
function, edit the live file (``sql/functions_v1.sql``, ``sql/functions_batches_v1.sql``), then
add a migration ``NNNN_<name>.py`` and copy the edited live file, unchanged, to
``migrations/sql/NNNN_<name>.sql``; the migration runs ``migration_sql("NNNN_<name>")``. A
migration that installs both files has one copy of each: ``NNNN_<name>.sql`` and
``NNNN_<name>.batches.sql`` (``migration_sql("NNNN_<name>.batches")``).
tests/test_migrations.py fails while the functions a fully migrated database has differ from the
live files, and when a migration reads anything but its own copy.

(Django's migration loader skips modules whose names start with an underscore, so this one is
not taken for a migration.)
"""

from __future__ import annotations

from importlib import resources


def migration_sql(name: str) -> str:
    """Text of ``migrations/sql/<name>.sql``: the frozen SQL of migration ``name``."""
    path = resources.files("django_fairqueue.migrations").joinpath(f"sql/{name}.sql")
    return path.read_text("utf-8")
