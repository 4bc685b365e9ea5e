"""The trainer's side of RL with omnistage: push new weights to a stage without disk
(``WeightSender``) and check them (``weights_checksum``). Imports torch and httpx only —
httpx when ``WeightSender`` is first used, so a stage process that imports the protocol does
not pay for it."""

from typing import TYPE_CHECKING, Any

from omnistage.rl.protocol import UpdateInfo, weights_checksum

if TYPE_CHECKING:
    from omnistage.rl.sender import WeightSender, WeightSyncError

__all__ = ["UpdateInfo", "WeightSender", "WeightSyncError", "weights_checksum"]


def __getattr__(name: str) -> Any:
    if name in ("WeightSender", "WeightSyncError"):
        from omnistage.rl import sender

        return getattr(sender, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
