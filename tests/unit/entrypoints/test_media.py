"""Media parts of a request decoded under the server's policy (``omnistage.entrypoints.media``):
every format, every source (data, file, http from a real local socket), every refusal with the
field it names. Media is made here with soundfile, PyAV and Pillow, never downloaded."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omnistage.entrypoints.cli_args import parse_serve_args
from omnistage.entrypoints.media import (
    MediaPolicy,
    check_counts,
    load_part,
    part_modality,
    resample,
)
from omnistage.entrypoints.openai.server_config import ServerConfig
from omnistage.errors import InvalidRequestError
from omnistage.models.media import MODALITIES, Audio, MediaItem, Video

FIELD = "messages[0].content[1]"
RATE = 16000


# -- media made here --------------------------------------------------------------------------


def tone(seconds: float = 1.0, rate: int = RATE, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


@functools.cache
def audio_bytes(fmt: str, seconds: float = 1.0, channels: int = 1) -> bytes:
    subtype = {"mp3": "MPEG_LAYER_III", "ogg": "VORBIS"}.get(fmt)
    buf = io.BytesIO()
    sf.write(buf, tone(seconds, channels=channels), RATE, format=fmt.upper(), subtype=subtype)
    return buf.getvalue()


@functools.cache
def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (32, 24), mode: str = "RGB") -> bytes:
    color: Any = (200, 30, 60, 0) if mode == "RGBA" else (200, 30, 60)
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


@functools.cache
def video_bytes(seconds: int = 2, rate: int = 10, audio: bool = False, fmt: str = "mp4") -> bytes:
    """An mpeg4 video whose frame i is gray level 10 * i (to see which frames were sampled),
    with an AAC track of ``seconds`` when asked; with ``rate=0``, audio only (an m4a)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        if rate:
            video = out.add_stream("mpeg4", rate=rate)
            video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        if audio:
            track = out.add_stream("aac", rate=RATE)
        for i in range(seconds * rate):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 10 * i, np.uint8), "rgb24")
            for packet in video.encode(frame):
                out.mux(packet)
        if rate:
            for packet in video.encode():
                out.mux(packet)
        if audio:
            samples = tone(seconds).reshape(1, -1)
            sound = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            sound.sample_rate = RATE
            for packet in [*track.encode(sound), *track.encode()]:
                out.mux(packet)
    return buf.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{b64(raw)}"


def input_audio(raw: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(raw), "format": fmt}}


def url_part(kind: str, url: str) -> dict[str, Any]:
    return {"type": kind, kind: {"url": url}}


POLICY = MediaPolicy()


def load(part: Any, policy: MediaPolicy = POLICY, **options: Any) -> MediaItem:
    return asyncio.run(load_part(part, FIELD, policy, options))


def refused(part: Any, policy: MediaPolicy = POLICY, **options: Any) -> InvalidRequestError:
    """The refusal of a part: always a plain 400 (a limit too: never a 413)."""
    with pytest.raises(InvalidRequestError) as info:
        load(part, policy, **options)
    assert type(info.value) is InvalidRequestError, info.value
    return info.value


# -- every format decodes -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg"])
def test_each_audio_format_decodes_to_mono_float32_at_its_rate(fmt):
    item = load(input_audio(audio_bytes(fmt), fmt))
    audio = item.value
    assert item.modality == "audio" and isinstance(audio, Audio)
    assert audio.sampling_rate == RATE and audio.samples.dtype == np.float32
    assert audio.samples.ndim == 1 and abs(audio.seconds - 1.0) < 0.1
    assert np.abs(audio.samples).max() <= 1.0 and np.abs(audio.samples).max() > 0.3


def test_stereo_audio_is_downmixed():
    audio = load(input_audio(audio_bytes("wav", channels=2))).value
    assert isinstance(audio, Audio) and audio.samples.ndim == 1
    np.testing.assert_allclose(audio.samples, tone(), atol=1e-4)


def test_audio_soundfile_cannot_read_is_decoded_by_pyav():
    m4a = video_bytes(rate=0, audio=True, fmt="mp4")  # AAC in mp4: not libsndfile's
    audio = load(url_part("audio_url", data_url("audio/mp4", m4a))).value
    assert isinstance(audio, Audio) and audio.sampling_rate == RATE
    assert abs(audio.seconds - 2.0) < 0.2 and audio.samples.dtype == np.float32


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_images_decode_to_rgb(fmt):
    part = url_part("image_url", data_url(f"image/{fmt.lower()}", image_bytes(fmt)))
    image = load(part).value
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (32, 24)
    assert np.abs(np.asarray(image)[0, 0].astype(int) - (200, 30, 60)).max() < 8


def test_a_transparent_image_lies_on_white_and_the_plain_string_form_is_accepted():
    part = {"type": "image_url", "image_url": data_url("image/png", image_bytes(mode="RGBA"))}
    image = load(part).value
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    assert tuple(np.asarray(image)[0, 0]) == (255, 255, 255)


def sampled_indices(video: Video) -> list[int]:
    return [round(float(f.mean()) / 10) for f in video.frames]


def test_video_frames_are_sampled_uniformly_at_the_asked_fps():
    part = url_part("video_url", data_url("video/mp4", video_bytes()))
    video = load(part, fps=3).value
    assert isinstance(video, Video) and video.audio is None
    assert video.frames.shape == (6, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.fps == 3.0
    assert sampled_indices(video) == [2, 5, 8, 12, 15, 18]  # nearest to the 6 spans' middles
    default = load(part).value
    assert isinstance(default, Video) and len(default.frames) == 4 and default.fps == 2.0


def test_video_frames_are_one_over_fps_apart_and_num_frames_spreads_them():
    """The sampled rate is the rate asked, also where the duration is no whole number of
    its periods (a processor turns frame times into positions); ``num_frames`` (vLLM's
    ``media_io_kwargs``) spreads that many over the duration and is nobody else's option."""
    part = url_part("video_url", data_url("video/mp4", video_bytes()))  # 2 s
    video = load(part, fps=2.25).value  # 4.5 periods: 4 frames (rounded), 1 / 2.25 s apart
    assert isinstance(video, Video) and len(video.frames) == 4 and video.fps == 2.25
    item = load(part, num_frames=5)
    assert isinstance(item.value, Video) and len(item.value.frames) == 5
    assert item.value.fps == 2.5 and "num_frames" not in item.options
    assert "num_frames" in str(refused(part, num_frames=0))


def test_video_sampling_never_repeats_source_frames_and_takes_at_least_one():
    part = url_part("video_url", data_url("video/mp4", video_bytes()))
    dense = load(part, fps=100).value  # the source has 20 frames at 10 fps
    assert isinstance(dense, Video) and dense.fps == 10.0
    assert sampled_indices(dense) == list(range(20))
    sparse = load(part, fps=0.01).value
    assert isinstance(sparse, Video) and len(sparse.frames) == 1 and sparse.fps == 0.5


def test_video_audio_track_is_decoded_when_asked():
    part = url_part("video_url", data_url("video/mp4", video_bytes(audio=True)))
    video = load(part, use_audio_in_video=True).value
    assert isinstance(video, Video) and isinstance(video.audio, Audio)
    assert video.audio.sampling_rate == RATE and abs(video.audio.seconds - 2.0) < 0.2
    assert video.audio.samples.ndim == 1 and video.audio.samples.dtype == np.float32
    assert len(video.frames) == 4
    without = load(part).value
    assert isinstance(without, Video) and without.audio is None
    silent = url_part("video_url", data_url("video/mp4", video_bytes()))
    silent_video = load(silent, use_audio_in_video=True).value
    assert isinstance(silent_video, Video) and silent_video.audio is None  # it has none


def test_content_hash_names_the_bytes_the_modality_and_the_decoding_options():
    wav = audio_bytes("wav")
    as_input = load(input_audio(wav))
    as_url = load(url_part("audio_url", data_url("audio/wav", wav)))
    assert as_input.content_hash == as_url.content_hash
    assert as_input.content_hash != load(input_audio(audio_bytes("flac"), "flac")).content_hash
    video = url_part("video_url", data_url("video/mp4", video_bytes(audio=True)))
    at_2 = load(video)
    assert at_2.options == {"fps": 2.0, "use_audio_in_video": False}
    assert at_2.content_hash == load(video, fps=2).content_hash
    assert at_2.content_hash != load(video, fps=3).content_hash
    assert at_2.content_hash != load(video, use_audio_in_video=True).content_hash


def test_resample_uses_the_given_rate():
    audio = Audio(tone(), RATE)
    assert resample(audio, RATE) is audio
    up = resample(audio, 24000)
    assert up.sampling_rate == 24000 and len(up.samples) == 24000
    assert up.samples.dtype == np.float32


# -- refusals of the part itself ----------------------------------------------------------------


def test_refusals_name_the_field():
    wav = b64(audio_bytes("wav"))
    cases: list[tuple[Any, str, str]] = [
        ({"type": "text", "text": "hi"}, f"{FIELD}.type", "not a media part"),
        ("nope", FIELD, "must be an object"),
        ({"type": "input_audio", "input_audio": "x"}, f"{FIELD}.input_audio", "object"),
        (
            {"type": "input_audio", "input_audio": {"data": wav, "format": "aac"}},
            f"{FIELD}.input_audio.format",
            "unsupported audio format",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": 3, "format": "wav"}},
            f"{FIELD}.input_audio.data",
            "base64 string",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "%%%%", "format": "wav"}},
            f"{FIELD}.input_audio.data",
            "not valid base64",
        ),
        (input_audio(b"RIFF but not audio at all"), f"{FIELD}.input_audio.data", "cannot decode"),
        ({"type": "image_url", "image_url": {}}, f"{FIELD}.image_url", "url"),
        (url_part("image_url", "ftp://x/a.png"), f"{FIELD}.image_url.url", "scheme"),
        (
            url_part("audio_url", data_url("image/png", image_bytes())),
            f"{FIELD}.audio_url.url",
            "mime type 'image/png' is not audio/*",
        ),
        (url_part("image_url", "data:;base64,AAAA"), f"{FIELD}.image_url.url", "mime type"),
        (url_part("image_url", "data:image/png,rawbytes"), f"{FIELD}.image_url.url", "base64"),
        (url_part("image_url", "data:image/png;base64"), f"{FIELD}.image_url.url", "data URL"),
        (
            url_part("image_url", data_url("image/png", b"\x89PNG not really")),
            f"{FIELD}.image_url.url",
            "cannot decode the image",
        ),
        (
            url_part("video_url", data_url("video/mp4", b"\x00\x00\x00 ftypmp42 junk")),
            f"{FIELD}.video_url.url",
            "cannot decode the video",
        ),
        (
            url_part("video_url", data_url("video/mp4", image_bytes())),
            f"{FIELD}.video_url.url",
            "cannot decode the video",
        ),
    ]
    for part, field, message in cases:
        error = refused(part)
        assert error.field == field, (part, error)
        assert message in str(error), (part, error)


def test_an_eps_image_is_refused_unopened():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    error = refused(url_part("image_url", data_url("image/eps", eps)))
    assert error.field == f"{FIELD}.image_url.url" and "cannot decode the image" in str(error)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"fps": 0}, "mm_processor_kwargs.fps"),
        ({"fps": "2"}, "mm_processor_kwargs.fps"),
        ({"fps": True}, "mm_processor_kwargs.fps"),
        ({"fps": float("nan")}, "mm_processor_kwargs.fps"),
        ({"use_audio_in_video": "yes"}, "mm_processor_kwargs.use_audio_in_video"),
    ],
)
def test_bad_video_options_are_refused_naming_them(options, field):
    part = url_part("video_url", data_url("video/mp4", video_bytes()))
    assert refused(part, **options).field == field


# -- limits, each checked before decoding -------------------------------------------------------


def test_a_100_mb_base64_payload_is_refused_from_its_length(monkeypatch):
    def no_decoding(*args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("decoded")

    monkeypatch.setattr(base64, "b64decode", no_decoding)
    huge = "A" * (100 << 20)
    for part, field in [
        (
            {"type": "input_audio", "input_audio": {"data": huge, "format": "wav"}},
            "input_audio.data",
        ),
        (url_part("audio_url", "data:audio/wav;base64," + huge), "audio_url.url"),
    ]:
        error = refused(part)
        assert error.field == f"{FIELD}.{field}"
        assert "--max-media-bytes" in str(error)
    # no clock here: nothing decodes (b64decode fails the test if called), and a wall-clock
    # bound failed on a loaded host (2.9 s) without any decoding


def test_the_byte_limit_counts_decoded_bytes():
    raw = audio_bytes("wav")
    with_newlines = "\n".join(b64(raw)[i : i + 76] for i in range(0, len(b64(raw)), 76))
    exact = replace(POLICY, max_media_bytes=len(raw))
    part = {"type": "input_audio", "input_audio": {"data": with_newlines, "format": "wav"}}
    assert isinstance(load(part, exact).value, Audio)
    error = refused(part, replace(exact, max_media_bytes=len(raw) - 1))
    assert "--max-media-bytes" in str(error)


def test_long_audio_is_refused_from_its_header(monkeypatch):
    short = replace(POLICY, max_audio_seconds=2.0)
    assert isinstance(load(input_audio(audio_bytes("wav", 1.5)), short).value, Audio)
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded"))
    for fmt in ("wav", "flac", "mp3", "ogg"):
        error = refused(input_audio(audio_bytes(fmt, 3.0), fmt), short)
        assert error.field == f"{FIELD}.input_audio.data", fmt
        assert error.field == f"{FIELD}.input_audio.data" and "--max-audio-seconds" in str(error)


def test_long_audio_read_by_pyav_is_refused():
    short = replace(POLICY, max_audio_seconds=1.0)
    m4a = url_part("audio_url", data_url("audio/mp4", video_bytes(rate=0, audio=True)))
    assert "--max-audio-seconds" in str(refused(m4a, short))
    video = url_part("video_url", data_url("video/mp4", video_bytes(audio=True)))
    error = refused(video, short, use_audio_in_video=True)
    assert error.field == f"{FIELD}.video_url.url" and "--max-audio-seconds" in str(error)


def test_audio_without_a_length_in_its_header_is_bounded_while_decoding(monkeypatch):
    monkeypatch.setattr(sf.SoundFile, "frames", property(lambda self: 2**63 - 1))  # unknown
    short = replace(POLICY, max_audio_seconds=2.0)
    audio = load(input_audio(audio_bytes("flac", 1.5), "flac"), short).value
    assert isinstance(audio, Audio) and abs(audio.seconds - 1.5) < 0.01
    error = refused(input_audio(audio_bytes("flac", 3.0), "flac"), short)
    assert "--max-audio-seconds" in str(error)


def test_video_without_a_length_in_its_header_is_sampled_and_bounded_while_decoding(
    monkeypatch,
):
    from omnistage.entrypoints.media import video as video_module

    monkeypatch.setattr(video_module, "duration", lambda stream, container: None)
    part = url_part("video_url", data_url("video/mp4", video_bytes()))
    video = load(part).value  # every 1/2 s from 0.25 s on
    assert isinstance(video, Video) and video.fps == 2.0
    assert sampled_indices(video) == [2, 7, 12, 17]
    for policy, message in [
        (replace(POLICY, max_video_seconds=1.0), "--max-video-seconds"),
        (replace(POLICY, max_video_frames=3), "--max-video-frames"),
        (replace(POLICY, max_video_decoded_bytes=3 * 64 * 48 * 3), "--max-video-decoded-bytes"),
    ]:
        error = refused(part, policy)
        assert message in str(error)


def test_large_images_are_refused_from_their_header(monkeypatch):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded"))
    small = replace(POLICY, max_image_pixels=32 * 24 - 1)
    part = url_part("image_url", data_url("image/png", image_bytes()))
    error = refused(part, small)
    assert error.field == f"{FIELD}.image_url.url"
    assert "32x24" in str(error) and "--max-input-image-pixels" in str(error)
    # A header claiming 100000 x 100000 pixels (a decompression bomb) costs nothing either.
    bomb = bytearray(image_bytes())
    bomb[16:24] = (100000).to_bytes(4, "big") * 2
    bomb[29:33] = zlib.crc32(bomb[12:29]).to_bytes(4, "big")  # IHDR's checksum
    error = refused(url_part("image_url", data_url("image/png", bytes(bomb))))
    assert error.field == f"{FIELD}.image_url.url"


def test_video_limits_are_checked_before_decoding(monkeypatch):
    part = url_part("video_url", data_url("video/mp4", video_bytes()))
    cases = [
        (replace(POLICY, max_video_seconds=1.5), {}, "--max-video-seconds"),
        (replace(POLICY, max_video_frames=5), {"fps": 3}, "6 frames"),
        (replace(POLICY, max_image_pixels=64 * 48 - 1), {}, "64x48"),
        (
            replace(POLICY, max_video_decoded_bytes=6 * 64 * 48 * 3 - 1),
            {"fps": 3},
            "6 frames of 64x48 pixels sampled at 3 fps take 55296 bytes decoded, more than the "
            "55295 bytes allowed (--max-video-decoded-bytes); ask for a lower fps",
        ),
    ]
    monkeypatch.setattr(av.container.InputContainer, "decode", lambda *a, **k: pytest.fail())
    for policy, options, message in cases:
        error = refused(part, policy, **options)
        assert error.field == f"{FIELD}.video_url.url"
        assert message in str(error)


def test_a_video_of_exactly_the_decoded_bytes_allowed_loads():
    part = url_part("video_url", data_url("video/mp4", video_bytes()))
    exact = replace(POLICY, max_video_decoded_bytes=6 * 64 * 48 * 3)
    video = load(part, exact, fps=3).value
    assert isinstance(video, Video) and video.frames.nbytes == exact.max_video_decoded_bytes


# -- file:// URLs -------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "tone.wav").write_bytes(audio_bytes("wav"))
    (tmp_path / "secret.wav").write_bytes(audio_bytes("wav"))
    (root / "escape.wav").symlink_to(tmp_path / "secret.wav")
    (root / "inside.wav").symlink_to(root / "tone.wav")
    (root / "sub").mkdir()
    return root


def test_files_under_the_allowed_folder_load(media_dir):
    policy = replace(POLICY, allowed_local_media_path=media_dir)
    for name in ("tone.wav", "inside.wav", "sub/../tone.wav"):
        item = load(url_part("audio_url", f"file://{media_dir}/{name}"), policy)
        assert isinstance(item.value, Audio), name
    spaced = media_dir / "a b.wav"
    spaced.write_bytes(audio_bytes("wav"))
    assert load(url_part("audio_url", f"file://localhost{media_dir}/a%20b.wav"), policy).value


def test_file_urls_are_refused_outside_the_allowed_folder(media_dir):
    policy = replace(POLICY, allowed_local_media_path=media_dir)
    where = f"{FIELD}.audio_url.url"
    cases = [
        (POLICY, f"file://{media_dir}/tone.wav", "--allowed-local-media-path DIR"),
        (policy, f"file://{media_dir}/../secret.wav", "outside the folder"),
        (policy, f"file://{media_dir}/escape.wav", "outside the folder"),
        (policy, f"file://{media_dir.parent}/nothing-here.wav", "outside the folder"),
        (policy, "file:///etc/passwd", "outside the folder"),
        (policy, f"file://{media_dir}/missing.wav", "cannot read the file"),
        (policy, f"file://{media_dir}/sub", "cannot read"),
        (policy, f"file://otherhost{media_dir}/tone.wav", "remote host"),
        (policy, "file:relative.wav", "absolute path"),
        (replace(policy, max_media_bytes=100), f"file://{media_dir}/tone.wav", "--max-media"),
    ]
    for case_policy, url, message in cases:
        error = refused(url_part("audio_url", url), case_policy)
        assert error.field == where and message in str(error), (url, error)


def test_a_fifo_is_refused_without_blocking(media_dir):
    import os

    os.mkfifo(media_dir / "pipe")
    policy = replace(POLICY, allowed_local_media_path=media_dir)
    started = time.monotonic()
    error = refused(url_part("audio_url", f"file://{media_dir}/pipe"), policy)
    # a blocking open would never return: any bound tells; 10 s leaves a loaded host room
    assert error.field == f"{FIELD}.audio_url.url" and time.monotonic() - started < 10


# -- http(s) URLs, from a real local server -----------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, status: int = 200, length: bool = True) -> None:
        self.send_response(status)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/tone.mp3":
            self._send(audio_bytes("mp3"))
        elif self.path == "/image.png":
            self._send(image_bytes())
        elif self.path == "/video.mp4":
            self._send(video_bytes())
        elif self.path == "/slow":  # answers after the timeout
            time.sleep(3)
            self._send(image_bytes())
        elif self.path == "/drip":  # headers at once, then a byte every 50 ms for 5 s
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        elif self.path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
        elif self.path == "/big-streamed":  # no length, more than the limit
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 1024)
        elif self.path == "/hop":
            self._redirect("/image.png")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{port}/image.png")
        elif self.path == "/loop":
            self._redirect("/loop")
        else:
            self._send(b"not found", 404)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the client hung up on a slow answer, as the tests mean it to


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


WEB = replace(POLICY, allowed_media_domains=frozenset({"127.0.0.1"}), media_fetch_timeout_s=0.5)


def test_urls_on_allowed_hosts_load(server):
    audio = load(url_part("audio_url", f"{server}/tone.mp3"), WEB).value
    assert isinstance(audio, Audio) and audio.sampling_rate == RATE
    assert isinstance(load(url_part("image_url", f"{server}/image.png"), WEB).value, Image.Image)
    video = load(url_part("video_url", f"{server}/video.mp4"), WEB).value
    assert isinstance(video, Video) and len(video.frames) == 4
    hopped = load({"type": "image_url", "image_url": f"{server}/hop"}, WEB)
    assert (
        hopped.content_hash == load(url_part("image_url", f"{server}/image.png"), WEB).content_hash
    )


def test_urls_are_refused_naming_the_field(server):
    port = server.rsplit(":", 1)[1]
    where = f"{FIELD}.image_url.url"
    cases = [
        (POLICY, f"{server}/image.png", "not allowed", InvalidRequestError),
        (
            WEB,
            f"http://localhost:{port}/image.png",
            "'localhost' is not allowed",
            InvalidRequestError,
        ),
        (WEB, f"{server}/away", "redirect target host 'localhost'", InvalidRequestError),
        (WEB, f"{server}/loop", "redirects", InvalidRequestError),
        (WEB, f"{server}/missing", "HTTP 404", InvalidRequestError),
        (
            replace(WEB, max_media_bytes=1000),
            f"{server}/big-declared",
            "--max-media",
            InvalidRequestError,
        ),
        (
            replace(WEB, max_media_bytes=1000),
            f"{server}/big-streamed",
            "--max-media",
            InvalidRequestError,
        ),
        (WEB, "http://127.0.0.1:1/image.png", "fetching it failed", InvalidRequestError),
        (WEB, "http://[::1/image.png", "not a valid URL", InvalidRequestError),
    ]
    for policy, url, message, kind in cases:
        error = refused(url_part("image_url", url), policy)
        assert type(error) is kind and error.field == where, (url, error)
        assert message in str(error), (url, error)


async def test_a_slow_url_times_out_quickly_while_other_loads_go_on(server):
    done: dict[str, float] = {}
    started = time.monotonic()

    async def timed(name: str, part: dict[str, Any]) -> Any:
        try:
            return await load_part(part, FIELD, WEB)
        except InvalidRequestError as exc:
            return exc
        finally:
            done[name] = time.monotonic() - started

    slow, drip, fast, inline = await asyncio.gather(
        timed("slow", url_part("image_url", f"{server}/slow")),
        timed("drip", url_part("image_url", f"{server}/drip")),
        timed("fast", url_part("image_url", f"{server}/image.png")),
        timed("inline", input_audio(audio_bytes("wav"))),
    )
    for error in (slow, drip):
        assert isinstance(error, InvalidRequestError) and error.field == f"{FIELD}.image_url.url"
        assert "--media-fetch-timeout-s" in str(error)
    assert isinstance(fast.value, Image.Image) and isinstance(inline.value, Audio)
    assert max(done["slow"], done["drip"]) < 1.5  # bounded by the 0.5 s timeout, not by 3-5 s
    assert max(done["fast"], done["inline"]) < min(done["slow"], done["drip"])


# -- counts -------------------------------------------------------------------------------------


def test_counts_over_the_limit_are_refused_naming_the_modality_and_limit():
    policy = replace(POLICY, limit_mm_per_prompt={"audio": 1, "image": 2, "video": 0})
    audio = load(input_audio(audio_bytes("wav")))
    check_counts([audio], policy)
    with pytest.raises(InvalidRequestError, match=r"2 audio items .* the 1 allowed") as info:
        check_counts([audio, audio], policy)
    assert info.value.field == "messages" and type(info.value) is InvalidRequestError  # a 400
    with pytest.raises(InvalidRequestError, match="takes no video input") as info:
        check_counts(["video"], policy, field="prompt")
    assert info.value.field == "prompt"
    parts = [{"type": "text"}, *[url_part("image_url", "http://x/a.png")] * 3]
    assert [part_modality(p) for p in parts] == [None, "image", "image", "image"]
    with pytest.raises(InvalidRequestError, match=r"3 image items .* the 2 allowed"):
        check_counts([m for m in map(part_modality, parts) if m], policy)


# -- configuration ------------------------------------------------------------------------------


def test_the_policy_defaults_are_the_servers():
    assert MediaPolicy.from_config(ServerConfig()) == MediaPolicy()
    assert set(MediaPolicy().limit_mm_per_prompt) == set(MODALITIES)


def test_media_flags_build_the_policy(tmp_path, capsys):
    config = parse_serve_args(
        [
            "--allowed-local-media-path", str(tmp_path),
            "--allowed-media-domains", "Upload.Example.org", "cdn.example.org,127.0.0.1",
            "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
            "--media-fetch-timeout-s", "3",
            "--max-media-bytes", "8MiB",
            "--max-audio-seconds", "30",
            "--max-input-image-pixels", "1000000",
            "--max-video-frames", "16",
            "--max-video-seconds", "20",
            "--max-video-decoded-bytes", "2GiB",
            "--max-media-decoded-bytes-in-flight", "3GiB",
        ],
        "omnistage",
    )  # fmt: skip
    assert config is not None
    policy = MediaPolicy.from_config(config)
    assert policy.allowed_local_media_path == tmp_path.resolve()
    assert policy.allowed_media_domains == {"upload.example.org", "cdn.example.org", "127.0.0.1"}
    assert dict(policy.limit_mm_per_prompt) == {"audio": 4, "image": 2, "video": 0}
    assert (policy.media_fetch_timeout_s, policy.max_media_bytes) == (3.0, 8 << 20)
    assert (policy.max_audio_seconds, policy.max_image_pixels) == (30.0, 1_000_000)
    assert (policy.max_video_frames, policy.max_video_seconds) == (16, 20.0)
    assert policy.max_video_decoded_bytes == 2 << 30
    assert policy.budget is not None and policy.budget.limit == 3 << 30


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--limit-mm-per-prompt", '{"images": 2}'], "--limit-mm-per-prompt"),
        (["--limit-mm-per-prompt", '{"audio": -1}'], "greater than or equal to 0"),
        (["--limit-mm-per-prompt", '{"audio": true}'], "valid integer"),
        (["--limit-mm-per-prompt", "image=2"], "JSON object"),
        (["--allowed-media-domains", "https://example.org/"], "host names"),
        (["--allowed-media-domains", "example.org:8080"], "host names"),
        (["--allowed-local-media-path", "/no/such/folder"], "existing folder"),
        (["--max-media-bytes", "0"], "--max-media-bytes"),
        (["--max-video-decoded-bytes", "0"], "--max-video-decoded-bytes"),
    ],
)
def test_bad_media_flags_are_refused_naming_them(capsys, flags, message):
    assert parse_serve_args(flags, "omnistage") is None
    assert message in capsys.readouterr().err


def test_a_small_file_of_a_high_rate_is_refused_from_its_header_before_decoding():
    """A FLAC of silence compresses to almost nothing; its decoded samples are bounded by
    --max-audio-decoded-bytes, checked from the header: nothing near their size is allocated."""
    import tracemalloc

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(192000 * 4, np.float32), 192000, format="FLAC")  # 4 s at 192 kHz
    part = {"type": "input_audio", "input_audio": {"data": b64(buf.getvalue()), "format": "flac"}}
    policy = MediaPolicy(max_audio_decoded_bytes=1 << 20)  # 1 MiB: about 1.4 s at 192 kHz
    tracemalloc.start()
    error = refused(part, policy)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "--max-audio-decoded-bytes" in str(error) and "3072000 bytes" in str(error)
    assert peak < 1 << 20  # refused before its 3 MB of samples existed
    assert load(part, MediaPolicy()).value.samples.size == 768000  # within the default
