"""Test settings: PostgreSQL from DATABASE_URL, else the embedded development server."""

from __future__ import annotations

import json
import os

import django
import environ

from django_fairqueue import devdb

# FAIRQUEUE_DB_NAME lets parallel tox environments share one embedded server without sharing a
# database (pytest-django creates "test_<name>" next to it). Ignored when DATABASE_URL is set.
DATABASES = {
    "default": environ.Env.db_url_config(
        devdb.database_url(os.environ.get("FAIRQUEUE_DB_NAME", "fairqueue")),
        engine="django.db.backends.postgresql",
    )
}

# The same test database through Django's psycopg connection pool (tests/test_pool.py).
DATABASES["pooled"] = {
    **DATABASES["default"],
    "OPTIONS": {"pool": {"min_size": 1, "max_size": 2}},
    "TEST": {"MIRROR": "default"},
}

SECRET_KEY = "django-fairqueue-tests-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "django.contrib.staticfiles",
    "django_fairqueue",
    # manage.py fairbench (tests/test_benchmark.py).
    "django_fairqueue.contrib.bench",
    # The Spark pipeline: fairpipeline, its admin, runfairworker --pipelines.
    "django_fairqueue.contrib.pipeline",
    # Tables and a pipeline for tests/test_pipeline.py.
    "tests.pipelineapp",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "tests.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

STATIC_URL = "/static/"

# Hashing passwords slowly protects nothing in tests.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

FAIRQUEUE: dict[str, object] = {
    # Tasks the worker tests run, in-process and in `runfairworker` subprocesses.
    "TASK_MODULES": ["tests.fairtasks"],
}
# Worker subprocesses started by tests get their short leases and intervals from here
# (tests/test_worker_processes.py).
# The pipeline app's own setting rides along in the same overrides, under its own name.
_overrides = json.loads(os.environ.get("FAIRQUEUE_TEST_OVERRIDES", "{}"))
FAIRQUEUE_PIPELINE: dict[str, object] = _overrides.pop("FAIRQUEUE_PIPELINE", {})
FAIRQUEUE.update(_overrides)

# Django's tasks framework on fairqueue (tests/test_backend.py), and one of Django's own
# backends beside it. Django 5.2 has it as the django-tasks backport, an app of its own.
_TASKS_PACKAGE = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
TASKS = {
    "default": {"BACKEND": "django_fairqueue.backend.FairQueueBackend"},
    "immediate": {"BACKEND": f"{_TASKS_PACKAGE}.backends.immediate.ImmediateBackend"},
}
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")
