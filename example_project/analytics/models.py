from django.db import models
from django.db.models.functions import Now


class DataObject(models.Model):
    """A row of a tenant's marketing data (tens of millions of them)."""

    tenant = models.CharField(max_length=50)
    price = models.FloatField()
    qty = models.IntegerField()
    discount = models.FloatField(default=0)
    tax_rate = models.FloatField(default=0)
    region = models.CharField(max_length=20, blank=True, default="")
    ordered_on = models.DateField(null=True, blank=True)
    #: Set on every save (and by the database for raw inserts): the pipeline's changed column,
    #: so ``fairpipeline recompute`` recomputes only the rows changed since the last run.
    updated_at = models.DateTimeField(auto_now=True, db_default=Now())

    class Meta:
        db_table = "data_objects"
        # Planning walks (tenant, id): a tenant's job reads only that tenant's index entries;
        # a recompute finds the rows changed since its last run by (tenant, updated_at).
        indexes = [
            models.Index(fields=["tenant", "id"], name="data_objects_tenant_id"),
            models.Index(fields=["tenant", "updated_at"], name="data_objects_tenant_updated"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class DataResult(models.Model):
    """The pipeline's sink: one row per data object, written by the formulas."""

    id = models.BigIntegerField(primary_key=True)
    tenant = models.CharField(max_length=50)
    subtotal = models.FloatField(null=True)
    total = models.FloatField(null=True)
    band = models.CharField(max_length=20, blank=True, default="")
    #: Every other rule's value by name (a tenant may have hundreds of rules).
    results = models.JSONField(null=True, blank=True)

    class Meta:
        db_table = "data_results"

    def __str__(self) -> str:
        return f"{self.tenant} #{self.pk}"


class DataResultLong(models.Model):
    """The pipeline's long output (``fairpipeline plan --output long``): one row per data
    object and rule."""

    row_id = models.BigIntegerField()
    rule = models.TextField()
    value = models.JSONField(null=True, blank=True)
    number = models.FloatField(null=True, blank=True)
    tenant = models.CharField(max_length=50)

    class Meta:
        db_table = "data_results_long"
        verbose_name = "data result (long)"
        verbose_name_plural = "data results (long)"
        constraints = [
            models.UniqueConstraint(fields=["row_id", "rule"], name="data_results_long_key")
        ]
        indexes = [models.Index(fields=["tenant", "rule"], name="data_results_long_rule")]

    def __str__(self) -> str:
        return f"{self.tenant} #{self.row_id} {self.rule}"


class TenantFormula(models.Model):
    """One rule of a tenant: ``target = expression`` (the pipeline's spreadsheet-like formula
    language), applied in ``position`` order."""

    tenant = models.CharField(max_length=50)
    position = models.PositiveIntegerField(default=0)
    target = models.CharField(max_length=63)
    expression = models.TextField()

    class Meta:
        ordering = ["tenant", "position"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "target"], name="tenant_formula_target")
        ]

    def __str__(self) -> str:
        return f"{self.tenant}: {self.target} = {self.expression}"
