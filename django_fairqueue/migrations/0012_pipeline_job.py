from django.db import migrations, models
import django.utils.timezone


class Migration(migrations.Migration):

    dependencies = [
        ("fairqueue", "0011_message_admin_indexes"),
    ]

    operations = [
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
    ]
