"""Component tags: the pipeline adopts components under the tags the control vocabulary
knows, and ``weights`` names every component of such a stage."""

from omnistage.models.diffusion.pipeline import COMPONENT_TAGS
from omnistage.stage import vocabulary


def test_the_pipeline_adopts_under_tags_the_vocabulary_knows():
    assert set(COMPONENT_TAGS.values()) == set(vocabulary.COMPONENT_TAGS)
    assert set(vocabulary.KNOWN_TAGS) >= set(vocabulary.COMPONENT_TAGS)


def test_weights_stands_for_every_component_tag():
    known = ["text_encoders", "transformer", "vae"]
    assert vocabulary.check_tags(["weights"], known) == known
    assert vocabulary.check_tags(["vae", "weights"], known) == [
        "vae",
        "text_encoders",
        "transformer",
    ]
    assert vocabulary.check_tags(["weights"], ["weights", "kv_cache"]) == ["weights"]
