"""The trainer's side of RL with omnistage: push new weights to a stage without disk
(``WeightSender``) and check them (``weights_checksum``). Imports torch and httpx only."""

from omnistage.rl.protocol import UpdateInfo, weights_checksum
from omnistage.rl.sender import WeightSender, WeightSyncError

__all__ = ["UpdateInfo", "WeightSender", "WeightSyncError", "weights_checksum"]
