"""STUB package (see omni.py)."""
