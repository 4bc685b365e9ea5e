"""STUB of vllm.envs: runtime.cleanup_dist_env_and_memory() calls disable_envs_cache()."""


def disable_envs_cache() -> None:
    return None
