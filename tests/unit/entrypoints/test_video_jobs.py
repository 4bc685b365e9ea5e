"""The video job store: a job's life, its file, the bounds in number and time, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.entrypoints.openai.video_jobs import JobNotFoundError, VideoJobs
from omnistage.errors import CapacityError, InvalidRequestError, ResourceNotFoundError
from omnistage.stage.media import OmniVideo

VIDEO = OmniVideo(mp4=b"mp4 bytes", width=48, height=32, num_frames=9, fps=8, seed=5)


def done() -> asyncio.Future[OmniVideo]:
    future: asyncio.Future[OmniVideo] = asyncio.get_running_loop().create_future()
    return future


async def settle() -> None:
    """The started tasks' first steps (a job goes in_progress)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def ended(jobs: VideoJobs, *job_ids: str) -> None:
    """Until the jobs completed or failed (a file is written on a worker thread)."""
    async with asyncio.timeout(10):
        while any(jobs.get(j).status in ("queued", "in_progress") for j in job_ids):
            await asyncio.sleep(0.01)


async def test_a_job_runs_keeps_its_mp4_and_is_deleted_with_it(tmp_path):
    jobs = VideoJobs(4, 60, str(tmp_path))
    gate = done()
    job = jobs.start("m", "a cat", lambda: gate, size="48x32")
    assert job.status == "queued" and job.object == "video" and job.id.startswith("video_")
    await settle()
    assert jobs.get(job.id).status == "in_progress"
    with pytest.raises(ResourceNotFoundError, match="poll"):
        jobs.content(job.id)
    gate.set_result(VIDEO)
    await ended(jobs, job.id)
    finished = jobs.get(job.id)
    assert (finished.status, finished.progress, finished.seconds, finished.num_frames) == (
        "completed", 100, "1.125", 9,
    )  # fmt: skip
    assert finished.completed_at and finished.expires_at == finished.completed_at + 60
    path = jobs.content(job.id)
    assert path.read_bytes() == b"mp4 bytes"
    await jobs.delete(job.id)
    assert not path.exists()
    with pytest.raises(JobNotFoundError):
        jobs.get(job.id)


async def test_a_failed_job_says_why_and_has_no_content(tmp_path):
    jobs = VideoJobs(4, 60, str(tmp_path))

    async def fail() -> OmniVideo:
        raise InvalidRequestError("num_frames", "too many")

    job = jobs.start("m", "a cat", fail)
    await ended(jobs, job.id)
    failed = jobs.get(job.id)
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "invalid_request" and "too many" in failed.error.message
    with pytest.raises(ResourceNotFoundError, match="failed"):
        jobs.content(job.id)


async def test_deleting_an_unfinished_job_cancels_its_work(tmp_path):
    jobs = VideoJobs(4, 60, str(tmp_path))
    cancelled = asyncio.Event()

    async def forever() -> OmniVideo:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    job = jobs.start("m", "a cat", forever)
    await settle()
    await jobs.delete(job.id)
    assert cancelled.is_set()
    assert jobs.list(None, 10, "desc") == ([], False)


async def test_jobs_are_bounded_in_number_and_time(tmp_path):
    now = [0.0]
    jobs = VideoJobs(2, 60, str(tmp_path), clock=lambda: now[0])
    gate = done()
    first = jobs.start("m", "a", lambda: gate)
    second = jobs.start("m", "b", lambda: gate)
    with pytest.raises(CapacityError, match="--max-video-jobs"):
        jobs.start("m", "c", lambda: gate)
    gate.set_result(VIDEO)
    await ended(jobs, first.id, second.id)
    third = jobs.start("m", "c", lambda: gate)  # the oldest finished one made room
    with pytest.raises(JobNotFoundError):
        jobs.get(first.id)
    await ended(jobs, third.id)
    path = jobs.content(third.id)
    now[0] += 59.0
    assert jobs.get(third.id).status == "completed"
    now[0] += 1.0  # its time to live is over
    with pytest.raises(JobNotFoundError):
        jobs.get(third.id)
    assert not path.exists()


async def test_list_is_ordered_paged_and_after_names_a_job(tmp_path):
    jobs = VideoJobs(8, 60, str(tmp_path))
    made = []
    for prompt in "abc":
        made.append(jobs.start("m", prompt, done).id)
    newest, has_more = jobs.list(None, 2, "desc")
    assert [j.id for j in newest] == made[::-1][:2] and has_more
    rest, has_more = jobs.list(newest[-1].id, 2, "desc")
    assert [j.id for j in rest] == made[:1] and not has_more
    assert [j.id for j in jobs.list(None, 0, "asc")[0]] == []
    with pytest.raises(JobNotFoundError):
        jobs.list("video_nope", 2, "asc")
    await jobs.close()


async def test_the_stores_own_folder_goes_when_it_closes():
    jobs = VideoJobs(4, 60)
    assert jobs.folder.is_dir()
    await jobs.close()
    assert not jobs.folder.exists()
