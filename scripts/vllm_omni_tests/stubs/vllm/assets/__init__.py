"""STUB of vllm.assets (see audio.py)."""
