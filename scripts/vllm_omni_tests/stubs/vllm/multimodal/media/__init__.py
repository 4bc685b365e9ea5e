"""STUB package (see audio.py)."""
