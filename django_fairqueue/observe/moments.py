"""Moments as the queue computes with them: aware datetimes, whatever ``USE_TZ`` is.

The queue's own statements (:mod:`django_fairqueue.db`) read ``timestamptz`` as aware
datetimes, and its schedules and statistics work in UTC. Django hands over naive datetimes when
``USE_TZ = False``: ``timezone.now()`` and the ORM's fields are then wall-clock times in
``TIME_ZONE``. Code that mixes the two (the operator's views above all) takes the moments
Django gives it through :func:`aware`, "now" from :func:`now` and today from :func:`today`, and
shows a moment in the zone Django would with :func:`local`. With ``USE_TZ = True`` every one
of them is what Django's own function returns.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, tzinfo
from typing import overload

from django.conf import settings
from django.utils import timezone

__all__ = ["as_django", "aware", "local", "now", "today", "zone"]


@overload
def aware(moment: datetime) -> datetime: ...


@overload
def aware(moment: None) -> None: ...


def aware(moment: datetime | None) -> datetime | None:
    """``moment`` if it is aware (or None); a naive one is a wall-clock time in ``TIME_ZONE``
    (what Django reads and writes with ``USE_TZ = False``), made aware in that zone."""
    if moment is not None and timezone.is_naive(moment):
        return timezone.make_aware(moment, timezone.get_default_timezone())
    return moment


def as_django(moment: datetime) -> datetime:
    """``moment`` as Django hands datetimes out (what its ORM reads, ``timezone.now()``): as it
    is with ``USE_TZ``, else a naive wall-clock time in ``TIME_ZONE``. For values the queue
    gives to Django's own APIs (``django.tasks``' task results)."""
    if settings.USE_TZ or timezone.is_naive(moment):
        return moment
    return timezone.make_naive(moment, timezone.get_default_timezone())


def now() -> datetime:
    """The current moment, aware (``timezone.now()`` with ``USE_TZ = True``)."""
    return timezone.now() if settings.USE_TZ else datetime.now(UTC)


def zone() -> tzinfo:
    """The zone Django shows times in: the current time zone with ``USE_TZ``, ``TIME_ZONE``
    without it (Django then shows every datetime as it is, a wall-clock time there)."""
    return timezone.get_current_timezone() if settings.USE_TZ else timezone.get_default_timezone()


def local(moment: datetime) -> datetime:
    """``moment`` in :func:`zone` (a naive one is there already)."""
    if timezone.is_naive(moment):
        return moment
    return timezone.localtime(moment, zone())


def today() -> date:
    """Today's date where Django shows times (``timezone.localdate()`` with ``USE_TZ``)."""
    return local(now()).date()
