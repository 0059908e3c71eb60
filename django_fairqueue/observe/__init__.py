"""Read-only pictures of the queue, for the admin, ``manage.py fairqueue`` and the metrics:
the per-tenant overview (:mod:`.overview`), why a message waits (:mod:`.waiting`), usage per
tenant (:mod:`.usage`), who holds the xmin horizon back (:mod:`.horizon`), and the spans of
runs (:mod:`.tracing`)."""
