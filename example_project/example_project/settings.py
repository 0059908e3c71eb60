"""Settings of the example project: a document-processing site shared by several tenants.

Configured from the environment (or an optional ``.env`` file next to ``manage.py``):
``DEBUG``, ``SECRET_KEY``, ``ALLOWED_HOSTS`` and ``DATABASE_URL``. Without ``DATABASE_URL`` the
embedded development PostgreSQL is started (see ``django_fairqueue.devdb``).
"""

from __future__ import annotations

from pathlib import Path

import environ

from django_fairqueue import devdb

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(DEBUG=(bool, True))
if (BASE_DIR / ".env").exists():
    environ.Env.read_env(BASE_DIR / ".env")

DEBUG = env("DEBUG")
SECRET_KEY = env("SECRET_KEY", default="django-insecure-fairqueue-example-only")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

DATABASES = {"default": env.db_url_config(devdb.database_url("fairqueue_example"))}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_fairqueue",
    "django_fairqueue.contrib.bench",  # manage.py fairbench (optional)
    "django_fairqueue.contrib.pipeline",  # the Spark pipeline: manage.py fairpipeline (optional)
    "documents",
    "analytics",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"

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

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
USE_I18N = True

STATIC_URL = "static/"
MEDIA_ROOT = BASE_DIR / "media"
MEDIA_URL = "media/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The point of the example is one tenant uploading thousands of files at once.
DATA_UPLOAD_MAX_NUMBER_FILES = 10_000

FAIRQUEUE: dict[str, object] = {}
