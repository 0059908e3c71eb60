"""System checks of the pipeline app: its settings, at start-up rather than at first use."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Tags, register


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from django_fairqueue.contrib.pipeline.spark import spark_settings

    try:
        spark_settings()  # FAIRQUEUE_PIPELINE's shape, then its SPARK entries
    except ValueError as exc:
        return [
            Error(
                str(exc),
                hint="See docs/howto/spark-pipeline.md, 'Local mode and clusters'.",
                id="fairqueue_pipeline.E001",
            )
        ]
    return []
