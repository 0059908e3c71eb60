from django.db import models


class DataRow(models.Model):
    tenant = models.CharField(max_length=50)
    price = models.FloatField()
    qty = models.IntegerField()
    discount = models.FloatField()
    note = models.TextField(null=True)  # noqa: DJ001  (NULL vs '' matters here)
    ordered_on = models.DateField(null=True)
    #: Grows when a row changes: the JSON pipeline's Source(changed_column=...).
    version = models.BigIntegerField(default=0)

    class Meta:
        db_table = "pipelinetest_data"
        indexes = [models.Index(fields=["tenant", "id"], name="pipelinetest_tenant_id")]

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class ResultRow(models.Model):
    id = models.BigIntegerField(primary_key=True)
    tenant = models.CharField(max_length=50)
    subtotal = models.FloatField(null=True)
    total = models.FloatField(null=True)
    band = models.TextField(null=True)  # noqa: DJ001  (NULL vs '' matters here)

    class Meta:
        db_table = "pipelinetest_result"

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class ExpectedRow(models.Model):
    """The same formulas computed by PostgreSQL alone (the oracle)."""

    id = models.BigIntegerField(primary_key=True)
    tenant = models.CharField(max_length=50)
    subtotal = models.FloatField(null=True)
    total = models.FloatField(null=True)
    band = models.TextField(null=True)  # noqa: DJ001  (NULL vs '' matters here)

    class Meta:
        db_table = "pipelinetest_expected"

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class JsonResultRow(models.Model):
    """A sink with a JSON results column: any number of rules per tenant."""

    id = models.BigIntegerField(primary_key=True)
    tenant = models.CharField(max_length=50)
    results = models.JSONField(null=True)

    class Meta:
        db_table = "pipelinetest_json_result"

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class LongResultRow(models.Model):
    """A long sink: one row per source row and rule."""

    row_id = models.BigIntegerField()
    rule = models.TextField()
    value = models.JSONField(null=True)
    number = models.DecimalField(max_digits=12, decimal_places=4, null=True)
    text = models.TextField(null=True)  # noqa: DJ001  (NULL vs '' matters here)
    tenant = models.CharField(max_length=50)

    class Meta:
        db_table = "pipelinetest_long_result"
        constraints = [
            models.UniqueConstraint(fields=["row_id", "rule"], name="pipelinetest_long_key")
        ]

    def __str__(self) -> str:
        return f"{self.row_id}.{self.rule}"


class StrictResultRow(models.Model):
    """A sink whose columns are NOT NULL, as Django makes them by default."""

    id = models.BigIntegerField(primary_key=True)
    tenant = models.CharField(max_length=50)
    band = models.CharField(max_length=20, blank=True, default="")
    total = models.FloatField(default=-1.0)
    due = models.DateField()
    stamp = models.TextField(blank=True, default="")

    class Meta:
        db_table = "pipelinetest_strict_result"

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class PriceRow(models.Model):
    """A lookup table: each tenant's prices by code."""

    tenant = models.CharField(max_length=50)
    code = models.TextField()
    price = models.DecimalField(max_digits=10, decimal_places=2)
    band = models.TextField()

    class Meta:
        db_table = "pipelinetest_price"

    def __str__(self) -> str:
        return f"{self.tenant} {self.code}"
