"""How a migration installs server functions: from the live files, naming only what it changes.

The server functions live in ``django_fairqueue/db/functions/<family>.sql``, the files the code
calls; a migration never carries a copy. To change a function, edit its family file and add a
migration with ``InstallFunctions("<family>")``, preceded by a ``RunSQL`` that drops each
signature the edit removed or changed (docs/explanation/architecture.md, "Changing a server function").
tests/test_migrations.py fails while a migrated database's functions differ from the live files,
and when a migration holds function text of its own.

Installing the live text from an old migration is safe: each family installed later supersedes
what an earlier one installed, so every path through the migrations ends with exactly the live
functions. Bodies are not checked at install (``check_function_bodies`` off, as ``pg_dump``
restores), so a function may name a column a later migration adds. Unapplying leaves the newer
bodies (there is no older text to go back to): a function keeps its name only through
compatible changes, an incompatible one gets a new name (``_v2``).

(Django's migration loader skips modules whose names start with an underscore.)
"""

from __future__ import annotations

from typing import Any

from django.db import router, transaction
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.operations.base import Operation
from django.db.migrations.state import ProjectState

from django_fairqueue.db import functions

#: Drop every fairqueue_* function of the current schema, and the triggers that call them.
DROP_ALL_FUNCTIONS = """
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p
        WHERE p.pronamespace = current_schema()::regnamespace
          AND starts_with(p.proname, 'fairqueue_')
    LOOP
        EXECUTE format('DROP FUNCTION %s CASCADE', f);
    END LOOP;
END
$$;
"""


class InstallFunctions(Operation):
    """Install the named families of ``db/functions/`` (``CREATE OR REPLACE``), in one transaction.

    ``first``: SQL run first in that transaction (rows the new functions rely on, say).
    Unapplying does nothing: see the module's docstring.
    """

    reversible = True
    reduces_to_sql = True

    def __init__(self, *families: str, first: str = "") -> None:
        if not families:
            raise ValueError("InstallFunctions needs at least one family")
        unknown = [f for f in families if f not in functions.FAMILIES]
        if unknown:
            raise ValueError(f"unknown function families {unknown}; known: {functions.FAMILIES}")
        self.families = tuple(sorted(families, key=functions.FAMILIES.index))
        self.first = first

    def deconstruct(self) -> tuple[str, tuple[str, ...], dict[str, Any]]:
        return (type(self).__qualname__, self.families, {"first": self.first} if self.first else {})

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        pass  # functions are not part of Django's model state

    def database_forwards(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState,
        to_state: ProjectState,
    ) -> None:
        alias = schema_editor.connection.alias
        if not router.allow_migrate(alias, app_label):
            return
        # SET LOCAL needs a transaction: a savepoint inside an atomic migration, a transaction
        # of its own in a non-atomic one. Either way the families install whole or not at all.
        with transaction.atomic(using=alias):
            # params=None: the text goes as it is (no placeholders; the functions use '%').
            if self.first:
                schema_editor.execute(self.first, params=None)
            schema_editor.execute("SET LOCAL check_function_bodies = off", params=None)
            schema_editor.execute(functions.sql(*self.families), params=None)
            schema_editor.execute("SET LOCAL check_function_bodies TO DEFAULT", params=None)

    def database_backwards(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState,
        to_state: ProjectState,
    ) -> None:
        pass  # the newer bodies stay: see the module's docstring

    def describe(self) -> str:
        return f"Install the server functions: {', '.join(self.families)}"

    @property
    def migration_name_fragment(self) -> str:
        return "functions_" + "_".join(self.families)
