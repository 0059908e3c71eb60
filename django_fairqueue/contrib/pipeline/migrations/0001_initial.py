"""The pipeline job model, taken over from the queue's migrations with its table and rows.

Until the pipeline became an app of its own, ``PipelineJob`` belonged to the queue
(``fairqueue`` migration 0012 created ``fairqueue_pipeline_job``). The queue's migration that
gave it up removed it from the queue's state only; this one adds it to this app's state only,
on the same table: no row is copied, none is lost.

The content type ``fairqueue.pipelinejob`` is renamed to ``fairqueue_pipeline.pipelinejob``
(unless the new one exists already), so the permissions granted on pipeline jobs and the
admin's log entries follow the model.
"""

from typing import Any

import django.utils.timezone
from django.apps import apps as installed_apps
from django.db import migrations, models

CONTENTTYPES = installed_apps.is_installed("django.contrib.contenttypes")


def move_content_type(apps: Any, schema_editor: Any) -> None:
    if not CONTENTTYPES:
        return
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    types = ContentType.objects.using(db)
    if not types.filter(app_label="fairqueue_pipeline", model="pipelinejob").exists():
        types.filter(app_label="fairqueue", model="pipelinejob").update(
            app_label="fairqueue_pipeline"
        )


def create_table_if_missing(apps: Any, schema_editor: Any) -> None:
    """A project that never used the pipeline may have dropped the empty table the queue's
    migrations left (as the how-to allows) before installing this app: create it again."""
    tables = schema_editor.connection.introspection.table_names()
    if "fairqueue_pipeline_job" not in tables:
        schema_editor.create_model(apps.get_model("fairqueue_pipeline", "PipelineJob"))


def restore_content_type(apps: Any, schema_editor: Any) -> None:
    if not CONTENTTYPES:
        return
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    types = ContentType.objects.using(db)
    if not types.filter(app_label="fairqueue", model="pipelinejob").exists():
        types.filter(app_label="fairqueue_pipeline", model="pipelinejob").update(
            app_label="fairqueue"
        )


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("fairqueue", "0019_pipeline_job_to_its_app"),
        *([("contenttypes", "0002_remove_content_type_name")] if CONTENTTYPES else []),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="PipelineJob",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("job_name", models.CharField(max_length=200, unique=True)),
                        ("pipeline", models.CharField(max_length=100)),
                        ("tenant", models.CharField(max_length=200)),
                        ("version", models.CharField(help_text="Content hash of the formula set.", max_length=16)),
                        ("formulas", models.JSONField(blank=True, help_text="The pinned formulas: [name, expression] pairs.", null=True)),
                        ("today", models.DateField(help_text="What TODAY() is for every batch of the job.")),
                        ("errors", models.JSONField(blank=True, default=dict, help_text="Error values written, per rule.")),
                        ("aggregates", models.JSONField(blank=True, help_text="The tenant aggregates its batches use (phase one).", null=True)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        ("cancelled_at", models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "fairqueue_pipeline_job",
                        "ordering": ["job_name"],
                    },
                ),
            ],
            database_operations=[],
        ),
        # (unapplied: the table stays, as the queue's migrations it came from expect)
        migrations.RunPython(create_table_if_missing, migrations.RunPython.noop),
        migrations.RunPython(move_content_type, restore_content_type),
    ]
