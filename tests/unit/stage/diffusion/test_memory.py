from omnistage.memory import process_resident_bytes
from omnistage.models.tiny_diffusion import TinyDiffusionSpec, build_pipeline
from omnistage.stage.diffusion.engine import DiffusionStageEngine
from tests.unit.stage.diffusion.conftest import diffusion_config

MiB = 1024 * 1024
# ~12.6 M transformer parameters: about 50 MB of fp32 weights, enough to measure RSS clearly.
LARGE = TinyDiffusionSpec(num_layers=12, num_heads=8, head_dim=32, with_text_encoder=False, seed=3)


def test_level2_sleep_releases_the_weights_from_resident_memory(tmp_path):
    folder = build_pipeline(tmp_path / "large", LARGE)
    engine = DiffusionStageEngine(diffusion_config(folder))
    try:
        weight_bytes = engine.pipeline.weight_bytes
        assert weight_bytes >= 32 * MiB
        before = process_resident_bytes()
        ack = engine.sleep(level=2)
        after = process_resident_bytes()
        assert before - after >= 0.9 * weight_bytes
        assert ack.freed_bytes >= 0.9 * weight_bytes
        assert engine.status()["memory"]["resident_bytes"] == 0
        engine.wake_up()
        assert engine.status()["weights_valid"]
    finally:
        engine.shutdown()
