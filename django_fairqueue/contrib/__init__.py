"""Optional Django apps that ship with django-fairqueue; the queue itself imports none of them.

Each is installed on its own, by adding it to ``INSTALLED_APPS`` beside ``"django_fairqueue"``.
"""
