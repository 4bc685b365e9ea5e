"""A finished video: its frames as an MP4 (H.264 in yuv420p, encoded with PyAV's FFmpeg), the
size, frame count, frame rate and seed. The stage encodes it where the frames are, so a
video crosses to the API process as its MP4, not as raw frames (81 frames of 832x480 are
97 MB of pixels and about a megabyte of MP4)."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import torch

from omnistage.stage.media import OmniVideo

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"  # what every player decodes; needs even sides (sizes are multiples of 16)


class VideoOutput(msgspec.Struct, tag="video"):
    """``mp4`` holds ``num_frames`` frames of ``width`` x ``height`` at ``fps``; ``pixels``
    (float32 ``[num_frames, height, width, 3]`` in [0, 1], before quantisation) only when the
    request asked for ``return_pixels``."""

    mp4: bytes
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    pixels: torch.Tensor | None = None

    def to_client(self) -> OmniVideo:
        return OmniVideo(
            mp4=self.mp4,
            width=self.width,
            height=self.height,
            num_frames=self.num_frames,
            fps=self.fps,
            seed=self.seed,
        )


def quantise(frames: torch.Tensor) -> np.ndarray:
    """Float frames ``[F, H, W, 3]`` in [0, 1] to uint8, rounded as ``to_png`` rounds."""
    return (frames * 255).round().to(torch.uint8).cpu().numpy()


def to_mp4(frames: np.ndarray, fps: int) -> bytes:
    """An MP4 of uint8 RGB frames ``[F, H, W, 3]`` at ``fps`` frames per second. Lossy, and
    not bit-stable: x264 may round a few pixels differently from one run to the next (seen
    with other work in the process, whatever its thread options); the exact frames are the
    output's ``pixels``."""
    import av
    from av.video.stream import VideoStream

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(CODEC, rate=fps)
        assert isinstance(stream, VideoStream)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = PIXEL_FORMAT
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)
    return buffer.getvalue()


def read_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """The uint8 RGB frames ``[F, H, W, 3]`` of an MP4 and its frame rate (for tests and
    clients of the video route)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate = float(stream.average_rate or stream.base_rate or 0)
    return np.stack(frames), rate
