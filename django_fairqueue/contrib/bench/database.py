"""Which database the benchmark may use: the configured one if its queue tables are empty, or a
scratch database next to it (``--scratch``), created fresh and dropped afterwards.

The benchmark TRUNCATEs the queue tables before every scenario. On a database that holds queue
rows that would destroy someone's work, so it refuses; a scratch database leaves the user's
data alone. A scratch database is recreated on every run, so it always carries the functions of
the checked-out ``db/functions/`` (a reused one would keep those it was migrated with).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.core.management import call_command
from django.db import DatabaseError, connections

from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.harness import BenchmarkError

SCRATCH_ALIAS = "fairbench_scratch"
SCRATCH_SUFFIX = "_fairbench"
#: The mark on scratch databases: only a database carrying it is ever dropped.
SCRATCH_COMMENT = "django-fairqueue fairbench scratch database (recreated by every --scratch run)"
#: PostgreSQL truncates identifiers longer than this (bytes).
MAX_IDENTIFIER = 63


def scratch_name(dbname: str) -> str:
    """``<dbname>_fairbench``, shortened to fit PostgreSQL's 63-byte identifiers."""
    room = MAX_IDENTIFIER - len(SCRATCH_SUFFIX)
    base = dbname.encode()[:room].decode(errors="ignore")
    return base + SCRATCH_SUFFIX


def tables_in_use(alias: str) -> list[str]:
    """Queue tables of ``alias`` that hold rows; raises BenchmarkError if they do not exist."""
    try:
        in_use = db.select_queue_tables_in_use(using=alias)
    except DatabaseError as exc:
        connections[alias].close()
        raise BenchmarkError(
            f"cannot read the queue tables of database {alias!r} ({exc}); run "
            "`manage.py migrate` first, or use --scratch"
        ) from exc
    return [name for name, used in in_use.items() if used]


@contextmanager
def benchmark_database(
    alias: str,
    *,
    scratch: bool,
    keep_scratch: bool = False,
    say: Callable[[str], None] = lambda message: None,
) -> Iterator[str]:
    """Yield the alias to benchmark on: ``alias`` itself, or a fresh scratch database's."""
    dbname = str(connections[alias].settings_dict["NAME"])
    # The locks live in the configured database, one for it and one for the scratch database
    # derived from it: a second run cannot drop or truncate the database the first one uses.
    target = scratch_name(dbname) if scratch else dbname
    with db.lock_benchmark(scratch=scratch, using=alias) as acquired:
        if not acquired:
            raise BenchmarkError(f"another fairbench run is using database {target!r}")
        if not scratch:
            used = tables_in_use(alias)
            if used:
                raise BenchmarkError(
                    f"database {dbname!r} holds queue data ({', '.join(used)}); the benchmark "
                    "empties the queue tables, so it will not run there. Use --scratch to "
                    f"benchmark in a separate database ({scratch_name(dbname)!r}) on the same "
                    "server, leaving this one alone."
                )
            try:
                yield alias
            finally:
                db.truncate_queue_tables(using=alias)  # as empty as we found them
            return
        with _scratch(alias, scratch_name(dbname), keep=keep_scratch, say=say) as scratch_alias:
            yield scratch_alias


@contextmanager
def _scratch(alias: str, name: str, *, keep: bool, say: Callable[[str], None]) -> Iterator[str]:
    exists, comment = db.select_database_comment(name, using=alias)
    if exists and comment != SCRATCH_COMMENT:
        raise BenchmarkError(
            f"database {name!r} exists and is not a fairbench scratch database; "
            "drop or rename it to use --scratch"
        )
    if exists:
        db.drop_scratch_database(name, using=alias)
    say(f"creating scratch database {name!r} and migrating it")
    db.create_scratch_database(name, comment=SCRATCH_COMMENT, using=alias)
    # A temporary alias with the configured connection settings and another database name.
    connections.settings[SCRATCH_ALIAS] = {**connections[alias].settings_dict, "NAME": name}
    try:
        call_command("migrate", database=SCRATCH_ALIAS, verbosity=0, interactive=False)
        yield SCRATCH_ALIAS
    finally:
        connections[SCRATCH_ALIAS].close()
        del connections[SCRATCH_ALIAS]
        del connections.settings[SCRATCH_ALIAS]
        if keep:
            say(f"kept scratch database {name!r} (its queue tables are empty)")
        else:
            db.drop_scratch_database(name, using=alias)
