from django.db import models


class DataObject(models.Model):
    """A row of a tenant's marketing data (tens of millions of them)."""

    tenant = models.CharField(max_length=50)
    price = models.FloatField()
    qty = models.IntegerField()
    discount = models.FloatField(default=0)
    tax_rate = models.FloatField(default=0)
    region = models.CharField(max_length=20, blank=True, default="")
    ordered_on = models.DateField(null=True, blank=True)

    class Meta:
        db_table = "data_objects"
        # Planning walks (tenant, id): a tenant's job reads only that tenant's index entries.
        indexes = [models.Index(fields=["tenant", "id"], name="data_objects_tenant_id")]

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
