"""STUB: tests/helpers/fixtures/config.py imports OMNI_PIPELINES at plugin import time and only
snapshots/restores it in the ``clean_pipeline_registry`` fixture (unused by the online tests)."""

OMNI_PIPELINES: dict = {}
