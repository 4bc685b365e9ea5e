"""The trainer's side of RL with omnistage: push new weights to a stage without disk
(``WeightSender``) and check them (``weights_checksum``). Imports torch and httpx only, and
both lazily: torch when a name of ``omnistage.rl.protocol`` is first used, httpx when
``WeightSender`` is — so the server's control code can import ``omnistage.rl.bounds`` (the
values' bounds, plain Python) without either."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnistage.rl.protocol import UpdateInfo, weights_checksum
    from omnistage.rl.sender import WeightSender, WeightSyncError

__all__ = ["UpdateInfo", "WeightSender", "WeightSyncError", "weights_checksum"]


def __getattr__(name: str) -> Any:
    if name in ("WeightSender", "WeightSyncError"):
        from omnistage.rl import sender

        return getattr(sender, name)
    if name in ("UpdateInfo", "weights_checksum"):
        from omnistage.rl import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
