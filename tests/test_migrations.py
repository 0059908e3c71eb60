"""Migrations that replace server-side functions leave exactly one callable version."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection

functions_v1 = importlib.import_module("django_fairqueue.migrations.0002_functions_v1")
claim_wait = importlib.import_module("django_fairqueue.migrations.0004_claim_wait")

# fairqueue_claim_v1 as migration 0002 installed it before 0004 (no p_wait_ms); the body does
# not matter to the migration, only the signature.
OLD_CLAIM = """
CREATE FUNCTION fairqueue_claim_v1(
    p_limit integer, p_lease interval, p_worker text, p_only bigint[] DEFAULT NULL,
    p_exclude bigint[] DEFAULT NULL, p_quantum integer DEFAULT NULL,
    p_maintain boolean DEFAULT true
) RETURNS SETOF bigint LANGUAGE sql AS $$ SELECT 1::bigint WHERE false $$;
"""


def signatures(name: str) -> list[str]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_get_function_identity_arguments(oid) FROM pg_proc WHERE proname = %s",
            [name],
        )
        return [row[0] for row in cur.fetchall()]


@pytest.mark.django_db
def test_0004_replaces_the_old_claim_signature_and_old_calls_still_work() -> None:
    with connection.cursor() as cur:
        # As before 0004 ran: the old claim only. (0002's reverse drops every signature.)
        cur.execute(functions_v1.DROP_V1)
        assert signatures("fairqueue_claim_v1") == []
        cur.execute(OLD_CLAIM)

        (operation,) = claim_wait.Migration.operations
        cur.execute(operation.sql)

        (claim,) = signatures("fairqueue_claim_v1")
        assert claim.endswith("p_maintain boolean, p_wait_ms integer"), claim
        (combined,) = signatures("fairqueue_complete_and_claim_v1")
        assert combined.endswith("p_quantum integer, p_wait_ms integer"), combined
        # A caller still passing the old arguments (a worker of the previous release during a
        # rolling deploy) resolves to the new function, which then never waits.
        cur.execute(
            "SELECT count(*) FROM fairqueue_claim_v1(1, interval '1 minute', 'old-worker', "
            "NULL, NULL, NULL, true)"
        )
        assert cur.fetchone() == (0,)
