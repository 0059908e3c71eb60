"""The test settings with the queue in a database of its own (tests/test_own_database.py):
``default`` is the test database, ``queue`` the database FAIRQUEUE_QUEUE_DB names on the
same server, and the queue's models are routed there."""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, FAIRQUEUE

DATABASES["queue"] = {**DATABASES["default"], "NAME": os.environ["FAIRQUEUE_QUEUE_DB"]}
DATABASE_ROUTERS = ["django_fairqueue.routers.QueueRouter"]
FAIRQUEUE["DATABASE"] = "queue"
