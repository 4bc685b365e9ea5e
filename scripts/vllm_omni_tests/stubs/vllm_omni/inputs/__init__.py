"""STUB package (see data.py)."""
