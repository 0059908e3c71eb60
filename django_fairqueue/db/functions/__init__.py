"""The server-side functions, a ``.sql`` file per family (the claim's two), and their loader.

Each file holds ``CREATE OR REPLACE FUNCTION`` (and the triggers that call its trigger
functions) for one family of the queue's work (``EXTRA_FILES``: a family's files beyond its
own). These files are the live definitions: the code
calls exactly these functions, and migrations install them from here (``InstallFunctions`` in
``migrations/_sql.py``), never from a copy. ``FAMILIES`` lists them in an order that installs
with ``check_function_bodies`` on: a SQL-language function comes after the functions it calls.
Migrations name families (``InstallFunctions("claim")``): a family renamed or merged must be
renamed in them too, else they fail to load.

A function keeps its ``_v1`` name through compatible changes only. An incompatible change adds
a new name (``fairqueue_claim_v2``), so workers of the old and the new release run side by side
during a rolling deploy; the old name is dropped a release later.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

#: The families, in install order.
FAMILIES = (
    "locks_clocks",
    "groups",
    "queues",
    "fold_counters",
    "unique_holds",
    "claim",
    "next_due",
    "settle",
    "errors",
    "schedules",
    "enqueue",
    "backlog",
    "verify_repair",
    "batches",
)


#: A family's files beyond its own: the claim's plan with channel groups reads as a file of its
#: own, and installs with the claim (the migrations name the claim family for both).
EXTRA_FILES = {"claim": ("plan_grouped",)}


def files(family: str) -> tuple[str, ...]:
    """The names (without ``.sql``) of the files of ``family``, in install order."""
    if family not in FAMILIES:
        raise ValueError(f"no server function family {family!r}; the families: {FAMILIES}")
    return (family, *EXTRA_FILES.get(family, ()))


@cache
def _read(family: str) -> str:
    return "\n\n".join(
        resources.files(__name__).joinpath(f"{name}.sql").read_text("utf-8")
        for name in files(family)
    )


def sql(*families: str) -> str:
    """The DDL of the named families, in the order given; with no name, of every family."""
    return "\n\n".join(_read(family) for family in families or FAMILIES)
