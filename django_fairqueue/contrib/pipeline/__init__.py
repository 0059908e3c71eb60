"""The data pipeline on Spark: per-tenant formulas over a big table, in fair work batches.

Declare pipelines in an app's ``pipelines`` module (see :mod:`.core`); plan jobs with
:func:`plan` or ``manage.py fairpipeline plan``; run batches with ``manage.py fairpipeline run``
or ``manage.py runfairworker --pipelines``. Guide: docs/howto/spark-pipeline.md.

PySpark is optional (``pip install 'django-fairqueue[spark]'``): declaring pipelines and
checking formulas need only this package; running batches needs PySpark, pyarrow and Java.
Importing this package never imports Django models, PySpark or pyarrow (Spark tasks import its
``datastore`` module on executors that have no Django settings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "FormulaError",
    "LongSink",
    "Lookup",
    "Pipeline",
    "PipelineError",
    "PipelineRunner",
    "Sink",
    "Source",
    "SparkUnavailable",
    "UnknownPipeline",
    "parse_formulas",
    "pipeline",
    "plan",
    "register",
    "registry",
]

if TYPE_CHECKING:
    from django_fairqueue.contrib.pipeline.core import (
        LongSink,
        Lookup,
        Pipeline,
        Sink,
        Source,
        UnknownPipeline,
        pipeline,
        register,
        registry,
    )
    from django_fairqueue.contrib.pipeline.execute import PipelineError
    from django_fairqueue.contrib.pipeline.formulas import FormulaError, parse_formulas
    from django_fairqueue.contrib.pipeline.runner import PipelineRunner, plan
    from django_fairqueue.contrib.pipeline.spark import SparkUnavailable

_WHERE = {
    "LongSink": "core",
    "Lookup": "core",
    "Pipeline": "core",
    "Sink": "core",
    "Source": "core",
    "UnknownPipeline": "core",
    "pipeline": "core",
    "register": "core",
    "registry": "core",
    "PipelineError": "execute",
    "FormulaError": "formulas",
    "parse_formulas": "formulas",
    "PipelineRunner": "runner",
    "plan": "runner",
    "SparkUnavailable": "spark",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(
            f"module 'django_fairqueue.contrib.pipeline' has no attribute {name!r}"
        )
    from importlib import import_module

    return getattr(import_module(f"django_fairqueue.contrib.pipeline.{module}"), name)
