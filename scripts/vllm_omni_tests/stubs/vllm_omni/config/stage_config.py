"""STUB: resolve_deploy_yaml is used only by the stage-CLI launcher (OmniServerStageCli), which
the omnistage plugin replaces. Calling it raises."""


def resolve_deploy_yaml(*args, **kwargs):
    raise RuntimeError(
        "vllm_omni.config.stage_config is stubbed: deploy YAMLs are not resolved here"
    )
