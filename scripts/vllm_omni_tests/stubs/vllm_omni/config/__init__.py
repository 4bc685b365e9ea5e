"""STUB of vllm_omni.config (the real package imports vLLM's engine config).

Only ``pipeline_registry.OMNI_PIPELINES`` (read by a fixture module at import time) and
``stage_config.resolve_deploy_yaml`` (used by the stage-CLI launcher, which the plugin replaces)
are provided.
"""
