"""The database layer of django-fairqueue: the server functions (``db/functions/``)."""
