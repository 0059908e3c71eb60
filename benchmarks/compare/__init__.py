"""django-fairqueue beside procrastinate, pgqueuer, django-tasks-db and raw SQL: see run.py."""
