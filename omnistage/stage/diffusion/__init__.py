"""The diffusion stage: diffusers-format image pipelines, batched, with sleep and wake.

``DiffusionStageEngine`` lives in ``omnistage.stage.diffusion.engine`` (importing it loads
diffusers); the request types in ``omnistage.stage.diffusion.params`` are light.
"""
