"""Bundled demo training jobs."""
