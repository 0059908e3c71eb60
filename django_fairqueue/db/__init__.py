"""The only code that runs queue SQL (being filled from store.py)."""
