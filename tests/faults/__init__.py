"""The fault-injection suite (issue 6): real ``runfairworker`` processes against real PostgreSQL.

Every scenario's task writes an execution-log row (message, attempt, worker pid, claim, start
and end time) in the database under test, so each check is a SQL query over that log. Sizes
come from ``FAIRQUEUE_FAULT_SCALE``: unset (``short``) in the normal test run, ``full`` in the
``faults`` tox environment. See docs/reliability.md.
"""
