"""STUB of vllm.assets.audio.

The example client (examples/online_serving/openai_chat_completion_client_for_multimodal_generation.py)
only reads ``AudioAsset(name).url`` and sends that URL to the server. The URL is built exactly as
vLLM builds it (its public S3 bucket); nothing is downloaded here. Loading the audio locally
(``audio_and_sample_rate``, ``get_local_path``) would need the network and raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urljoin

VLLM_S3_BUCKET_URL = "https://vllm-public-assets.s3.us-west-2.amazonaws.com"
ASSET_DIR = "multimodal_asset"


@dataclass(frozen=True)
class AudioAsset:
    name: str

    @property
    def filename(self) -> str:
        return f"{self.name}.ogg"

    @property
    def url(self) -> str:
        return urljoin(VLLM_S3_BUCKET_URL, f"{ASSET_DIR}/{self.name}.ogg")

    def get_local_path(self):
        raise RuntimeError(f"vllm.assets is stubbed: {self.url} cannot be downloaded here")

    @property
    def audio_and_sample_rate(self):
        raise RuntimeError(f"vllm.assets is stubbed: {self.url} cannot be downloaded here")
