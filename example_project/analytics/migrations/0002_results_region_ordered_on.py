from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("analytics", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="dataobject",
            name="region",
            field=models.CharField(blank=True, default="", max_length=20),
        ),
        migrations.AddField(
            model_name="dataobject",
            name="ordered_on",
            field=models.DateField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="dataresult",
            name="results",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
