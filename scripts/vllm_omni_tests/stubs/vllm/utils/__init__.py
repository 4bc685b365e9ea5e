"""STUB of vllm.utils (see argparse_utils.py)."""
