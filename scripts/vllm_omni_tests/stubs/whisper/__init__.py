"""STUB of openai-whisper.

tests/helpers/media.py transcribes generated speech with ``whisper.load_model("small")``. The
package installs from PyPI, but its weights are downloaded from a CDN at first use, which cannot
be reached here. ``load_model`` therefore raises: every check that needs a transcript (the
example tests, keyword/similarity checks at --run-level advanced_model/full_model) FAILS rather
than passing without one. Set VLLM_OMNI_TESTS_REAL_WHISPER=1 in run.sh on a machine with
network access to install and use the real package instead.
"""


class WhisperUnavailable(RuntimeError):
    pass


def load_model(name: str, *args, **kwargs):
    raise WhisperUnavailable(
        f"whisper is stubbed: the {name!r} Whisper weights cannot be downloaded here, so no transcript can be made"
    )
