"""How a stage process starts: the options its launcher passes it (imports no torch, so a
server can spawn its stages before it imports the heavy parts of itself)."""

from __future__ import annotations

import msgspec


class StartupOptions(msgspec.Struct):
    """How a stage process starts. A restarted stage comes back as the old one was: asleep
    at ``sleep_level`` (``None``: awake; level 2: its weights are never loaded), paused, and
    with the weight updates it had taken (``weight_sources``, replayed over the checkpoint)."""

    sleep_level: int | None = None
    paused: bool = False
    weight_sources: list[str] = []
    heartbeat_interval_s: float = 1.0


_startup = msgspec.json.Decoder(StartupOptions)


def encode_startup(options: StartupOptions) -> str:
    return msgspec.json.encode(options).decode()


def decode_startup(data: str) -> StartupOptions:
    return _startup.decode(data)
