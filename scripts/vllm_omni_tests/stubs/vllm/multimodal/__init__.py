"""STUB of vllm.multimodal (see media/audio.py)."""
