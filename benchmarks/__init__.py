"""Benchmarks that need more than the app: see ``compare`` (a tox environment of its own)."""
