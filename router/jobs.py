"""``/v1/videos`` jobs: a generation the client polls for, and its MP4 once done. No sockets here.

A job is created at once (``queued``), waits for room in the engine (a 429 from
admission only delays it), runs as one request (``in_progress``, its progress
from the denoise worker's step count) and ends ``completed`` with its MP4, or
``failed`` with the request's error. The table holds at most ``max_jobs``;
finished jobs are dropped ``ttl_s`` after they finished. Jobs live in the
router's memory: a restarted engine has none (documented in docs/api.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router.errors import EngineError

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
ROOM_POLL_S = 0.05  # how often a queued job asks admission again


@dataclass
class VideoJob:
    """One job, shaped as OpenAI's video object by :meth:`describe`."""

    id: str
    prompt: str
    model: str
    size: str
    seconds: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = QUEUED
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None
    content: bytes | None = None
    request_id: str | None = None  # the engine request running it, once submitted
    progress: int = 0
    task: asyncio.Task | None = None

    def describe(self, progress_of: Callable[[str], int | None]) -> dict:
        if self.status == IN_PROGRESS and self.request_id is not None:
            self.progress = max(self.progress, progress_of(self.request_id) or 0)
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "size": self.size, "seconds": self.seconds, "prompt": self.prompt,
                "error": self.error, "remixed_from_video_id": None}


# run(job) submits the job's request (setting job.request_id), waits for it and returns the MP4.
Runner = Callable[[VideoJob], Awaitable[bytes]]


class JobTable:
    def __init__(self, max_jobs: int, ttl_s: float, progress_of: Callable[[str], int | None]):
        self.max_jobs, self.ttl_s, self.progress_of = max_jobs, ttl_s, progress_of
        self._jobs: dict[str, VideoJob] = {}  # in creation order

    def _expire(self) -> None:
        now = time.time()
        for job_id in [j.id for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]:
            del self._jobs[job_id]

    def create(self, prompt: str, model: str, size: str, seconds: str, run: Runner) -> VideoJob:
        self._expire()
        if len(self._jobs) >= self.max_jobs:
            raise EngineError(429, "too_many_jobs", f"{len(self._jobs)} video jobs are held, the most --max-jobs "
                              "allows: wait for some to finish and expire, or delete finished ones", "router", "")
        job = VideoJob(id=f"video_{uuid.uuid4().hex}", prompt=prompt, model=model, size=size, seconds=seconds)
        self._jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, run))
        return job

    async def _run(self, job: VideoJob, run: Runner) -> None:
        try:
            job.content = await run(job)
            job.status, job.progress = COMPLETED, 100
        except EngineError as e:
            job.status, job.error = FAILED, {"code": e.type, "message": e.message}
        except Exception as e:  # a bug must not leave the job running forever
            job.status, job.error = FAILED, {"code": "internal_error", "message": f"{type(e).__name__}: {e}"}
        finally:
            job.completed_at = int(time.time())
            job.expires_at = int(time.time() + self.ttl_s)
            job.task = None

    def get(self, job_id: str) -> VideoJob:
        self._expire()
        job = self._jobs.get(job_id)
        if job is None:
            raise EngineError(404, "not_found", f"no video job {job_id!r} (unknown, deleted or expired)",
                              "router", "")
        return job

    def listed(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        """A page of jobs (oldest first for ``asc``), starting after the job ``after``; and whether more follow."""
        self._expire()
        jobs = list(self._jobs.values())
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        if job.status in (QUEUED, IN_PROGRESS):
            raise EngineError(409, "job_running", f"video job {job_id} is {job.status}: it can be deleted once it "
                              "has completed or failed", "router", "")
        del self._jobs[job_id]

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in (QUEUED, IN_PROGRESS, COMPLETED, FAILED)}
        for j in self._jobs.values():
            out[j.status] += 1
        return out


async def wait_for_room(admit: Callable[[], None], deadline: float) -> None:
    """Call ``admit`` until the engine takes the job (429 and 503 only mean "not yet"), or the deadline passes."""
    while True:
        try:
            admit()
            return
        except EngineError as e:
            if e.status not in (429, 503) or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(ROOM_POLL_S)
