"""Django settings for the two Django-based systems, django-fairqueue and django-tasks-db.

``COMPARE_DSN`` names the system's own database; ``COMPARE_DJANGO_APP`` (``fairqueue`` or
``django-tasks-db``) which one is installed. Workers started by the benchmark use these settings
too (``python -m django runfairworker`` / ``db_worker``).
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["COMPARE_DSN"])
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db["dbname"],
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        # Persistent connections, as long-running processes want them. With Django's default
        # (0), db_worker's close_old_connections() reconnects for every job.
        "CONN_MAX_AGE": 600,
    }
}
APP = os.environ.get("COMPARE_DJANGO_APP", "fairqueue")

SECRET_KEY = "django-fairqueue-compare-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth"]
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"level": "WARNING"},
}

if APP == "fairqueue":
    INSTALLED_APPS += ["django_fairqueue"]
    FAIRQUEUE: dict[str, object] = {"TASK_MODULES": ["benchmarks.compare.tasks_fairqueue"]}
    if "COMPARE_FAIRNESS" in os.environ:
        # the timeshare scenario's variants (absent, the default: a ``--baseline`` from before
        # fairness by time refuses a key it does not know)
        FAIRQUEUE["FAIRNESS"] = os.environ["COMPARE_FAIRNESS"]
else:
    # django_fairqueue too, unused: the benchmark's CPU watch imports its models.
    INSTALLED_APPS += ["django_tasks", "django_tasks_db", "django_fairqueue"]
    TASKS = {
        "default": {
            "BACKEND": "django_tasks_db.DatabaseBackend",
            "QUEUES": ["default"],
        }
    }
