"""Video generation as jobs (``/v1/videos``): each job a background task, its MP4 a file.

A job is OpenAI's (and vLLM-Omni's) ``video`` object: ``queued`` → ``in_progress`` →
``completed`` (its MP4 under the store's folder) or ``failed`` (its ``error``). The store is
bounded in number (``max_jobs``) and time (a finished job ``ttl_s`` after it finished goes,
with its file): when full, the oldest job that finished makes room; when every kept job is still
unfinished, a new one is refused (429). Deleting a job cancels its task (aborting its request
in the stages) and removes its file. The folder is the server's own unless it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from omnistage.entrypoints.serve.errors import error_status
from omnistage.errors import CapacityError, ResourceNotFoundError
from omnistage.stage.media import OmniVideo

JobStatus = Literal["queued", "in_progress", "completed", "failed"]


class JobError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """OpenAI's ``Video`` fields, and vLLM-Omni's extras (``media_type``,
    ``inference_time_s``) and the video's own (frames, rate, seed) once made."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus = "queued"
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str
    size: str | None = None
    seconds: str | None = None
    remixed_from_video_id: str | None = None
    error: JobError | None = None
    media_type: Literal["video/mp4"] = "video/mp4"
    inference_time_s: float | None = None
    num_frames: int | None = None
    fps: int | None = None
    seed: int | None = None


@dataclass
class _Entry:
    job: VideoJob
    task: asyncio.Task[None] | None = None
    path: Path | None = None
    finished_at: float | None = None


class VideoJobs:
    def __init__(
        self,
        max_jobs: int,
        ttl_s: float,
        folder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.clock = clock
        self._owned = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="omnistage-videos-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}

    def start(
        self, model: str, prompt: str, run: Callable[[], Awaitable[OmniVideo]], **fields: Any
    ) -> VideoJob:
        """A new job running ``run`` in the background (``CapacityError`` when full)."""
        self._make_room()
        job = VideoJob(
            id=f"video_{uuid.uuid4().hex}", model=model, prompt=prompt, created_at=int(time.time()),
            **fields,
        )  # fmt: skip
        entry = _Entry(job)
        self._entries[job.id] = entry
        entry.task = asyncio.ensure_future(self._run(entry, run))
        return job.model_copy()

    async def _run(self, entry: _Entry, run: Callable[[], Awaitable[OmniVideo]]) -> None:
        started = self.clock()
        entry.job.status = "in_progress"
        try:
            video = await run()
            path = self.folder / f"{entry.job.id}.mp4"
            await asyncio.to_thread(path.write_bytes, video.mp4)
            entry.path = path
            entry.job.status, entry.job.progress = "completed", 100
            entry.job.size = f"{video.width}x{video.height}"
            entry.job.seconds = f"{video.num_frames / video.fps:g}"
            entry.job.num_frames, entry.job.fps, entry.job.seed = (
                video.num_frames, video.fps, video.seed,
            )  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _, code = error_status(exc)
            entry.job.status = "failed"
            entry.job.error = JobError(code=str(code), message=str(exc) or type(exc).__name__)
        entry.finished_at = self.clock()
        entry.job.inference_time_s = round(entry.finished_at - started, 3)
        entry.job.completed_at = int(time.time())
        entry.job.expires_at = entry.job.completed_at + int(self.ttl_s)

    def _expire(self) -> None:
        now = self.clock()
        for job_id, entry in list(self._entries.items()):
            if entry.finished_at is not None and now - entry.finished_at >= self.ttl_s:
                self._remove(job_id)

    def _make_room(self) -> None:
        self._expire()
        if len(self._entries) < self.max_jobs:
            return
        finished = [e for e in self._entries.values() if e.finished_at is not None]
        if not finished:
            raise CapacityError(
                "video",
                f"{self.max_jobs} video jobs are unfinished (--max-video-jobs); retry when one "
                "finishes, or delete one",
            )
        self._remove(finished[0].job.id)  # the oldest: kept in creation order

    def _remove(self, job_id: str) -> None:
        entry = self._entries.pop(job_id)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    def get(self, job_id: str) -> VideoJob:
        return self._entry(job_id).job.model_copy()

    def _entry(self, job_id: str) -> _Entry:
        self._expire()
        entry = self._entries.get(job_id)
        if entry is None:
            raise JobNotFoundError(job_id)
        return entry

    def content(self, job_id: str) -> Path:
        """The job's MP4 (a 404 while it is unfinished, or if it failed: no video exists)."""
        entry = self._entry(job_id)
        if entry.job.status == "failed":
            raise ResourceNotFoundError("video_id", "the video job failed: see its error")
        if entry.path is None:
            raise ResourceNotFoundError(
                "video_id", f"the video job is {entry.job.status}: poll it until completed"
            )
        return entry.path

    def list(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        """The jobs by creation time (``order`` asc or desc), after the job ``after``; and
        whether more follow."""
        self._expire()
        # Kept in creation order: jobs created in one second keep it too.
        jobs = [e.job for e in self._entries.values()]
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise JobNotFoundError(after, "after")
            jobs = jobs[ids.index(after) + 1 :]
        return [j.model_copy() for j in jobs[:limit]], len(jobs) > limit

    async def delete(self, job_id: str) -> None:
        entry = self._entry(job_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await entry.task  # its request aborted in the stages before the answer
        self._entries.pop(job_id, None)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    async def close(self) -> None:
        """Cancel every unfinished job; remove the store's own folder."""
        for job_id in list(self._entries):
            await self.delete(job_id)
        if self._owned:
            shutil.rmtree(self.folder, ignore_errors=True)


class JobNotFoundError(ResourceNotFoundError):
    """No video job has this id (HTTP 404)."""

    def __init__(self, job_id: str, field: str = "video_id") -> None:
        super().__init__(field, f"Video not found: no video job {job_id!r}")
