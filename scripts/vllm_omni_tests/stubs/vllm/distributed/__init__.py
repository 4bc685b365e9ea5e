"""STUB of vllm.distributed (no process groups exist in the test process)."""
