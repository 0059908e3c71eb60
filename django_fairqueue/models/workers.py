"""The worker registry."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q
from django.utils.translation import gettext_lazy as _


class WorkerState(models.TextChoices):
    RUNNING = "running", _("running")
    STOPPED = "stopped", _("stopped")  # deregistered on a graceful stop
    DEAD = "dead", _("dead")  # no beat for WORKER_DEAD_AFTER; its leases were expired


class WorkerRecord(models.Model):
    """A worker process in the registry (:mod:`django_fairqueue.runtime.worker_registry`).

    Written only by the registry's statements (:mod:`django_fairqueue.db.worker_store`): a worker
    registers before it claims, beats every ``WORKER_HEARTBEAT`` seconds and marks itself stopped on
    a graceful stop; the maintenance loop marks a silent one dead. Rows of stopped and dead workers
    are kept for a day (the pruner), so an operator can see what ran where.
    """

    worker_id = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    version = models.CharField(max_length=50)
    concurrency = models.IntegerField()
    #: channel filters (--channels / --exclude-channels); empty lists: every channel
    channels = models.JSONField(default=list)
    exclude_channels = models.JSONField(default=list)
    #: the queues it claims from (--queues), in its order; NULL: every queue
    queues = models.JSONField(null=True, blank=True, default=None)
    state = models.CharField(max_length=16, choices=WorkerState.choices)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    last_claim_at = models.DateTimeField(null=True, blank=True)
    #: messages running at the last beat, and handled since the process started
    running = models.IntegerField(default=0)
    handled = models.BigIntegerField(default=0)
    stopped_at = models.DateTimeField(null=True, blank=True)
    #: how it learns of new messages: "notify" (its LISTEN was seen to work), "polling: <why>"
    #: (it checked, no notification came through: it polls on purpose), "" (not known: it
    #: was started with --no-listen, or has not checked yet)
    wakeups = models.CharField(max_length=300, blank=True, default="", db_default="")
    #: ``host:pid`` of the ``runfairworker --processes`` supervisor that started it ("" for a
    #: worker started on its own): the admin lists a supervisor's children together
    supervisor = models.CharField(max_length=300, blank=True, default="", db_default="")
    #: a supervised worker's slot as its supervisor saw it when starting this process
    #: (``runfairworker --processes``): {"slot", "restarts", "young_deaths", "crash_loop",
    #: "exits": the last few, newest last}; NULL: not supervised
    supervision = models.JSONField(null=True, blank=True, default=None)

    class Meta:
        db_table = "fairqueue_worker"
        ordering = ["-heartbeat_at"]
        indexes = [
            # the dead-worker check: registered workers by their last beat
            models.Index(
                F("heartbeat_at"),
                name="fq_worker_beat_idx",
                condition=Q(state=WorkerState.RUNNING),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=WorkerState.values), name="fq_worker_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.worker_id} ({self.state})"
