"""``/v1/videos`` jobs and recorded images: their lifecycle over a :class:`~router.core.job_store.JobStore`. No sockets.

A video job is created at once (``queued``), waits for room in the engine (a 429
from admission only delays it), runs as one request (``in_progress``, its
progress from the denoise worker's step count) and ends ``completed`` with its
MP4 as a file in the store, or ``failed`` with the request's error. Deleting a
job that has not ended cancels its request first. Each image a
generation made is recorded as a finished row of kind ``image``. The table holds
at most ``max_jobs`` rows; an image record gives way (oldest first) to a new
row. Finished rows are removed ``ttl_s`` after they finished.

Rows outlive the router. At its start, the video jobs left unfinished run again
from the start, through the same checks as a new job (``prepare``); one that no
longer passes them fails with ``engine_restarted``. A stop is no failure: a job
the stop interrupts stays unfinished in the store, for the next start.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.core.errors import EngineError
from router.core.job_store import JobRow, JobStore

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
VIDEO, IMAGE = "video", "image"
NOUN = {VIDEO: "video job", IMAGE: "image"}
ROOM_POLL_S = 0.05  # how often a queued job asks admission again
SWEEP_S = 60.0  # how often expired rows are removed when nobody asks
log = logging.getLogger("disagg.jobs")


@dataclass
class Live:
    """What only this process knows of an unfinished job."""

    status: str = QUEUED
    progress: int = 0
    request_id: str | None = None  # the engine request running it, once submitted
    error: dict | None = None  # an end the store could not record
    task: asyncio.Task | None = None


# run(started) waits for room, submits the job's request (calling started(request_id)) and returns the MP4.
Started = Callable[[str], None]
Runner = Callable[[Started], Awaitable[bytes]]
# A stored job's runner at a restart, from its row and request fields; raises when it can no longer run.
Prepare = Callable[[JobRow, dict], Awaitable[Runner]]


class JobTable:
    def __init__(self, store: JobStore, max_jobs: int, ttl_s: float, progress_of: Callable[[str], int | None]):
        self.store, self.max_jobs, self.ttl_s, self.progress_of = store, max_jobs, ttl_s, progress_of
        self._live: dict[str, Live] = {}
        self._background: list[asyncio.Task] = []
        store.set_ttl(ttl_s)  # the --job-ttl of this start holds for rows an earlier one finished
        self.expire()

    # --- the router's start and stop --------------------------------------------------------------
    def start(self, prepare: Prepare) -> None:
        """In the event loop, at the router's start: run the unfinished video jobs again, sweep periodically."""
        rows = self.store.unfinished(VIDEO)
        for row in rows:
            self.store.update(row.id, status=QUEUED, progress=0)
            self._live[row.id] = Live()
        self._background = [asyncio.create_task(self._resume(rows, prepare)), asyncio.create_task(self._sweep())]

    async def stop(self) -> None:
        """Cancel every run (their rows stay unfinished) before the dispatcher fails what is in flight."""
        tasks = self._background + [live.task for live in self._live.values() if live.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _resume(self, rows: list[JobRow], prepare: Prepare) -> None:
        for row in rows:
            live = self._live[row.id]
            try:
                run = await prepare(row, self.store.request_of(row.id) or {})
            except Exception as e:  # a check the job no longer passes (another model, an adapter gone)
                why = e.message if isinstance(e, EngineError) else str(e)
                self._end(row.id, live, error={"code": "engine_restarted", "message": "the engine restarted and "
                                               f"cannot run this job again: {why}"})
                continue
            if row.id in self._live:  # not deleted while it was being checked
                live.task = asyncio.create_task(self._run(row.id, run, live))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.expire()
            except sqlite3.Error as e:
                log.error("could not remove expired jobs from %s: %s", self.store.dir, e)

    # --- video jobs -------------------------------------------------------------------------------
    def create(self, prompt: str, model: str, size: str, seconds: str, request: dict, run: Runner) -> dict:
        """A new video job (``request``: the fields that run it again after a restart), started at once; its
        description."""
        self.expire()
        if not self._make_room():
            raise EngineError(429, "too_many_jobs", f"{self.store.count()} video jobs are held, the most "
                              "--max-jobs allows: wait for some to finish and expire, or delete finished ones",
                              "router", "")
        row = JobRow(id=f"video_{uuid.uuid4().hex}", kind=VIDEO, prompt=prompt, model=model, size=size,
                     status=QUEUED, seconds=seconds)
        self.store.add(row, request)
        live = self._live[row.id] = Live()
        live.task = asyncio.create_task(self._run(row.id, run, live))
        return self._described(row, live)

    async def _run(self, job_id: str, run: Runner, live: Live) -> None:
        try:
            mp4 = await run(lambda request_id: self._started(job_id, live, request_id))
        except EngineError as e:
            if e.type != "shutting_down":  # the engine stops: the job stays unfinished, for the next start
                self._end(job_id, live, error={"code": e.type, "message": e.message})
            return
        except Exception as e:  # a bug must not leave the job running forever
            self._end(job_id, live, error={"code": "internal_error", "message": f"{type(e).__name__}: {e}"})
            return
        try:
            name = await asyncio.to_thread(self.store.write_content, job_id, ".mp4", mp4)
        except OSError as e:  # a full disk fails this job, nothing else
            self._end(job_id, live, error={"code": "storage_error", "message": f"the MP4 could not be stored "
                                           f"in {self.store.files}: {e}"})
            return
        self._end(job_id, live, content=name)

    def _started(self, job_id: str, live: Live, request_id: str) -> None:
        live.status, live.request_id = IN_PROGRESS, request_id
        self._record(job_id, status=IN_PROGRESS)

    def _end(self, job_id: str, live: Live, error: dict | None = None, content: str | None = None) -> None:
        now = int(time.time())
        live.status, live.error, live.task = (COMPLETED, None, None) if content else (FAILED, error, None)
        live.progress = 100 if content else live.progress
        if self._record(job_id, status=live.status, progress=live.progress, completed_at=now,
                        expires_at=int(now + self.ttl_s), error=error, content=content):
            del self._live[job_id]
        else:  # the row says unfinished: this process says failed (the next start runs it again)
            live.status, live.error = FAILED, {"code": "storage_error", "message": "the job's end could not be "
                                               f"recorded in {self.store.dir} (see the engine's log)"}

    def _record(self, job_id: str, **changes) -> bool:
        try:
            self.store.update(job_id, **changes)
            return True
        except sqlite3.Error as e:
            log.error("could not record job %s in %s: %s", job_id, self.store.dir, e)
            return False

    async def delete(self, job_id: str) -> bool:
        """Remove a job, its row and its file; a queued or running one is cancelled first (its request leaves
        the workers), so that no start runs it again. True when it was cancelled."""
        row, live = self._get(job_id, VIDEO)
        task = live.task if live is not None else None
        running = task is not None and not task.done()
        if running:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.store.delete(row)
        self._live.pop(job_id, None)
        return running

    def counts(self) -> dict[str, int]:
        """Video jobs by status (metrics)."""
        out = {s: 0 for s in (QUEUED, IN_PROGRESS, COMPLETED, FAILED)}
        for status, n in self.store.counts(VIDEO).items():
            if status in (COMPLETED, FAILED):
                out[status] += n
        for live in self._live.values():
            out[live.status] += 1
        return out

    # --- image records ----------------------------------------------------------------------------
    async def record_images(self, prompt: str, model: str, size: str, pngs: list[bytes]) -> None:
        """Each PNG as a finished row of kind ``image``. Never fails the generation that made them: with no
        room (a table full of video jobs) or a store error, the rest are not recorded and the log says why."""
        try:
            self.expire()
        except sqlite3.Error as e:
            log.warning("images not recorded in %s: %s", self.store.dir, e)
            return
        for png in pngs:
            job_id = f"img_{uuid.uuid4().hex}"
            try:
                name = await asyncio.to_thread(self.store.write_content, job_id, ".png", png)
                if not self._make_room():
                    self.store.remove_file(name)
                    log.warning("images not recorded: %d video jobs fill --max-jobs", self.store.count())
                    return
                now = int(time.time())
                self.store.add(JobRow(id=job_id, kind=IMAGE, prompt=prompt, model=model, size=size,
                                      status=COMPLETED, progress=100, created_at=now, completed_at=now,
                                      expires_at=int(now + self.ttl_s), content=name))
            except (OSError, sqlite3.Error) as e:
                log.warning("image %s not recorded in %s: %s", job_id, self.store.dir, e)
                return

    def _make_room(self) -> bool:
        """Below --max-jobs rows, evicting the oldest image records if need be; False if only jobs are left."""
        while self.store.count() >= self.max_jobs:
            oldest = self.store.oldest_finished(IMAGE)
            if oldest is None:
                return False
            self.store.delete(oldest)
        return True

    # --- both kinds -------------------------------------------------------------------------------
    def expire(self) -> None:
        for row in self.store.expired(time.time()):
            self.store.delete(row)

    def _get(self, job_id: str, kind: str) -> tuple[JobRow, Live | None]:
        self.expire()
        row = self.store.get(job_id, kind)
        if row is None:
            raise EngineError(404, "not_found", f"no {NOUN[kind]} {job_id!r} (unknown, deleted or expired)",
                              "router", "")
        return row, self._live.get(job_id)

    def describe(self, job_id: str, kind: str) -> dict:
        return self._described(*self._get(job_id, kind))

    def listed(self, kind: str, after: str | None, limit: int, order: str) -> tuple[list[dict], bool]:
        """A page of ``kind``'s rows described (oldest first for ``asc``), after the row ``after``; and whether
        more follow."""
        self.expire()
        rows, more = self.store.page(kind, after, limit, order)
        return [self._described(row, self._live.get(row.id)) for row in rows], more

    def _described(self, row: JobRow, live: Live | None) -> dict:
        """As OpenAI's video object (an image record: the same without seconds and remix)."""
        status, progress, error = row.status, row.progress, row.error
        if live is not None:
            if live.status == IN_PROGRESS and live.request_id is not None:
                live.progress = max(live.progress, self.progress_of(live.request_id) or 0)
            status, progress, error = live.status, live.progress, live.error
        out = {"id": row.id, "object": row.kind, "model": row.model, "status": status, "progress": progress,
               "created_at": row.created_at, "completed_at": row.completed_at, "expires_at": row.expires_at,
               "size": row.size, "prompt": row.prompt, "error": error}
        if row.kind == VIDEO:
            out |= {"seconds": row.seconds, "remixed_from_video_id": None}
        return out

    async def content(self, job_id: str, kind: str) -> bytes:
        """A finished row's file (read off the event loop)."""
        row, live = self._get(job_id, kind)
        if row.content is None:
            status, error = (live.status, live.error) if live is not None else (row.status, row.error)
            raise EngineError(409, "not_ready", f"{NOUN[kind]} {job_id} is {status}, it has no content"
                              + (f": {error['message']}" if error else ""), "router", "")
        try:
            return await asyncio.to_thread(self.store.read_content, row.content)
        except OSError as e:
            raise EngineError(500, "storage_error", f"the content of {job_id} could not be read: {e}",
                              "router", "") from None


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
