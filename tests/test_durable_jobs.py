"""Jobs that survive a restart: ``/v1/videos`` jobs and image records in SQLite plus files under ``--data-dir``.

The store on its own (a tmp dir, no engine): rows, pages, the lock, atomic files, expiry, strays. The job
table over it with stand-in runs: a storage error fails that job only, a stop leaves a job unfinished, a
restart runs it again or fails it ``engine_restarted``, image records give way at --max-jobs. Then real
engines on the tiny model: images listed with their PNGs, a full files dir failing one job, expiry, a second
engine refused on a data dir in use, and (heavy) a restart: finished jobs download byte for byte, a running
one completes, one whose adapter is gone fails ``engine_restarted``.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from common.config.engine import DATA_DIR_ENV
from common.runtime.engine_process import EngineProcess
from router.core.errors import EngineError, FieldError
from router.core.job_store import DataDirInUse, JobRow, JobStore
from router.core.jobs import JobTable

FAST = {"size": "32x32", "seconds": "0.25", "num_inference_steps": 2}


def _video_row(i: int, status: str = "queued", **kw) -> JobRow:
    return JobRow(id=f"video_{i}", kind="video", prompt=f"p{i}", model="tiny", size="32x32", status=status,
                  seconds="0.25", created_at=1000 + i, **kw)


# --- the store ----------------------------------------------------------------------------------------------
def test_rows_page_in_creation_order_by_kind(tmp_path):
    store = JobStore(tmp_path)
    for i in range(5):
        store.add(_video_row(i), {"prompt": f"p{i}", "num_inference_steps": i})
    store.add(JobRow(id="img_a", kind="image", prompt="i", model="tiny", size="16x16", status="completed"))
    ids = lambda rows: [r.id for r in rows]  # noqa: E731
    rows, more = store.page("video", None, 3, "asc")
    assert ids(rows) == ["video_0", "video_1", "video_2"] and more
    rows, more = store.page("video", "video_3", 3, "desc")
    assert ids(rows) == ["video_2", "video_1", "video_0"] and not more
    assert store.page("video", "img_a", 3, "asc") == ([], False)  # another kind's id is no cursor
    assert ids(store.page("image", None, 10, "desc")[0]) == ["img_a"]
    assert store.get("img_a", "video") is None and store.get("video_4", "video").prompt == "p4"
    assert store.request_of("video_2") == {"prompt": "p2", "num_inference_steps": 2}
    store.update("video_1", status="failed", completed_at=2000, error={"code": "timeout", "message": "slow"})
    assert store.get("video_1", "video").error == {"code": "timeout", "message": "slow"}
    assert store.count() == 6 and store.counts("video") == {"queued": 4, "failed": 1}


def test_a_second_open_of_a_dir_in_use_is_refused_until_the_first_closes(tmp_path):
    first = JobStore(tmp_path / "d")
    with pytest.raises(DataDirInUse) as e:
        JobStore(tmp_path / "d")
    assert str(e.value) == (f"data dir {tmp_path / 'd'} is in use by another engine (it holds "
                            f"{tmp_path / 'd' / 'lock'}): pass another --data-dir")
    first.close()
    JobStore(tmp_path / "d").close()


def test_files_are_whole_or_absent_and_strays_go_at_open(tmp_path):
    store = JobStore(tmp_path)
    name = store.write_content("video_1", ".mp4", b"x" * 1000)
    store.add(_video_row(1, "completed", completed_at=1, content=name))
    assert store.read_content(name) == b"x" * 1000 and sorted(p.name for p in store.files.iterdir()) == [name]
    (store.files / "video_2.mp4.tmp").write_bytes(b"half")  # a write a crash cut short
    (store.files / "video_3.mp4").write_bytes(b"whole")  # a file whose row was deleted just before a crash
    store.close()
    store = JobStore(tmp_path)
    assert sorted(p.name for p in store.files.iterdir()) == [name]
    shutil.rmtree(store.files)
    store.files.write_bytes(b"")  # files/ is no directory: every write fails, and leaves nothing
    with pytest.raises(OSError):
        store.write_content("video_4", ".mp4", b"y")


def test_rows_expire_by_the_ttl_of_this_start_and_take_their_files(tmp_path):
    store = JobStore(tmp_path)
    now = int(time.time())
    for i, done in enumerate([now - 100, now - 10]):
        store.add(_video_row(i, "completed", completed_at=done, expires_at=done + 3600,
                             content=store.write_content(f"video_{i}", ".mp4", b"v")))
    store.add(_video_row(2))  # unfinished: never expires
    table = JobTable(store, max_jobs=8, ttl_s=50, progress_of=lambda _: None)  # a shorter --job-ttl
    assert [r.id for r in store.page("video", None, 10, "asc")[0]] == ["video_1", "video_2"]
    assert [p.name for p in store.files.iterdir()] == ["video_1.mp4"]
    assert table.describe("video_1", "video")["expires_at"] == now - 10 + 50


# --- the job table over the store ---------------------------------------------------------------------------
def _run_returning(data: bytes, gate: asyncio.Event | None = None):
    async def run(started):
        started("rid")
        if gate is not None:
            await gate.wait()
        return data

    return run


async def _settled(table: JobTable, job_id: str) -> dict:
    while (d := table.describe(job_id, "video"))["status"] in ("queued", "in_progress"):
        await asyncio.sleep(0.01)
    return d


def test_a_storage_error_fails_that_job_only(tmp_path):
    async def body():
        store = JobStore(tmp_path)
        table = JobTable(store, max_jobs=8, ttl_s=60, progress_of=lambda _: None)
        write = store.write_content

        def full_once(job_id, suffix, data):
            if data == b"first":
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(job_id, suffix, data)

        store.write_content = full_once
        a = table.create("a", "tiny", "32x32", "0.25", {"prompt": "a"}, _run_returning(b"first"))
        b = table.create("b", "tiny", "32x32", "0.25", {"prompt": "b"}, _run_returning(b"second"))
        a, b = await _settled(table, a["id"]), await _settled(table, b["id"])
        assert a["status"] == "failed" and a["error"]["code"] == "storage_error"
        assert "No space left on device" in a["error"]["message"] and str(store.files) in a["error"]["message"]
        assert b["status"] == "completed" and await table.content(b["id"], "video") == b"second"
        with pytest.raises(EngineError) as e:
            await table.content(a["id"], "video")
        assert e.value.type == "not_ready" and "No space left" in e.value.message
        await table.stop()

    asyncio.run(body())


def test_a_stop_leaves_jobs_unfinished_and_the_next_start_runs_or_fails_them(tmp_path):
    async def first_life():
        store = JobStore(tmp_path)
        table = JobTable(store, max_jobs=8, ttl_s=60, progress_of=lambda _: None)
        table.start(lambda row, request: None)
        gate = asyncio.Event()  # never set: both are running when the engine stops
        ids = [table.create(p, "tiny", "32x32", "0.25", {"prompt": p}, _run_returning(b"v", gate))["id"]
               for p in ("again", "adapter gone")]

        async def shutting_down(started):
            raise EngineError(503, "shutting_down", "engine is shutting down", "router", "")

        ids.append(table.create("drained", "tiny", "32x32", "0.25", {"prompt": "drained"}, shutting_down)["id"])
        await asyncio.sleep(0.05)
        assert table.describe(ids[0], "video")["status"] == "in_progress"
        await table.stop()
        store.close()
        return ids

    async def second_life(ids):
        store = JobStore(tmp_path)
        assert [r.status for r in store.unfinished("video")] == ["in_progress", "in_progress", "queued"]
        table = JobTable(store, max_jobs=8, ttl_s=60, progress_of=lambda _: None)

        async def prepare(row, request):
            if request["prompt"] == "adapter gone":
                raise FieldError("lora_name", "no adapter 'style' is loaded")
            return _run_returning(f"{request['prompt']} done".encode())

        table.start(prepare)
        done = [await _settled(table, i) for i in ids]
        assert [d["status"] for d in done] == ["completed", "failed", "completed"]
        assert done[1]["error"] == {"code": "engine_restarted", "message": "the engine restarted and cannot run "
                                    "this job again: lora_name: no adapter 'style' is loaded"}
        assert await table.content(ids[2], "video") == b"drained done"
        await table.stop()

    asyncio.run(second_life(asyncio.run(first_life())))


def test_image_records_give_way_to_new_rows_at_max_jobs(tmp_path):
    async def body():
        store = JobStore(tmp_path)
        table = JobTable(store, max_jobs=3, ttl_s=60, progress_of=lambda _: None)
        await table.record_images("cat", "tiny", "16x16", [b"1", b"2", b"3"])
        await table.record_images("dog", "tiny", "16x16", [b"4"])  # evicts the oldest image, "1"
        images, _ = table.listed("image", None, 10, "asc")
        assert [await table.content(i["id"], "image") for i in images] == [b"2", b"3", b"4"]
        assert images[0]["object"] == "image" and images[0]["prompt"] == "cat" and "seconds" not in images[0]
        gate = asyncio.Event()
        video = table.create("v", "tiny", "32x32", "0.25", {}, _run_returning(b"v", gate))  # evicts "2"
        assert table.listed("video", None, 10, "asc")[0] == [table.describe(video["id"], "video")]
        await table.record_images("eel", "tiny", "16x16", [b"5"])  # evicts "3"
        kept = table.listed("image", None, 10, "asc")[0]
        assert [await table.content(i["id"], "image") for i in kept] == [b"4", b"5"]
        assert sorted(p.name for p in store.files.iterdir()) == sorted(f"{i['id']}.png" for i in kept)
        for _ in range(2):  # evict "4", then "5"
            table.create("v", "tiny", "32x32", "0.25", {}, _run_returning(b"v", gate))
        with pytest.raises(EngineError) as e:  # only jobs are left: a new one is refused
            table.create("v", "tiny", "32x32", "0.25", {}, _run_returning(b"v", gate))
        assert e.value.type == "too_many_jobs"
        await table.record_images("fox", "tiny", "16x16", [b"6"])  # no room: not recorded, no error
        assert table.listed("image", None, 10, "asc")[0] == []
        await table.stop()

    asyncio.run(body())


# --- real engines -------------------------------------------------------------------------------------------
TTL_S = 3


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory("tiny", extra=["--job-ttl", str(TTL_S)])


def _create(engine, **fields) -> dict:
    r = engine.http.post("/v1/videos", json={"prompt": "a fox", **FAST, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def _settled_job(engine, job_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (v := engine.http.get(f"/v1/videos/{job_id}").json())["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline, v
        time.sleep(0.05)
    return v


def test_images_are_listed_with_the_generations_pngs(engine):
    r = engine.http.post("/v1/images/generations", json={"prompt": "a red kite", "n": 2, "size": "32x16",
                                                         "num_inference_steps": 2, "seed": 4})
    assert r.status_code == 200, r.text
    pngs = [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]
    listed = engine.http.get("/v1/images", params={"order": "asc"}).json()
    assert listed["object"] == "list" and not listed["has_more"]
    images = listed["data"][-2:]
    assert [(i["object"], i["prompt"], i["size"], i["status"]) for i in images] == [
        ("image", "a red kite", "32x16", "completed")] * 2
    assert all(i["id"].startswith("img_") and i["expires_at"] == i["completed_at"] + TTL_S for i in images)
    for image, png in zip(images, pngs):
        content = engine.http.get(f"/v1/images/{image['id']}/content")
        assert content.headers["content-type"] == "image/png" and content.content == png
    assert not [v for v in engine.http.get("/v1/videos").json()["data"] if v["id"].startswith("img_")]
    assert engine.http.get(f"/v1/videos/{images[0]['id']}").status_code == 404


def test_a_files_dir_that_cannot_take_the_mp4_fails_that_job_and_the_engine_goes_on(engine):
    files = engine.workdir / "jobs" / "files"
    files.rename(files.with_name("away"))
    files.write_bytes(b"")  # a regular file where the files dir was: the write fails (even as root)
    try:
        failed = _settled_job(engine, _create(engine)["id"])
    finally:
        files.unlink()
        files.with_name("away").rename(files)
    assert failed["status"] == "failed" and failed["error"]["code"] == "storage_error"
    assert "the MP4 could not be stored in" in failed["error"]["message"]
    assert engine.http.get("/health").status_code == 200
    ok = _settled_job(engine, _create(engine)["id"])
    assert ok["status"] == "completed" and (files / f"{ok['id']}.mp4").is_file()


def test_an_expired_jobs_file_is_gone(engine):
    job = _settled_job(engine, _create(engine)["id"])
    path = engine.workdir / "jobs" / "files" / f"{job['id']}.mp4"
    assert job["status"] == "completed" and path.is_file()
    time.sleep(max(0.0, job["expires_at"] - time.time()) + 1.1)  # whole seconds
    assert engine.http.get(f"/v1/videos/{job['id']}").status_code == 404
    assert not path.exists()


@pytest.mark.heavy  # two engines side by side
def test_a_second_engine_on_a_data_dir_in_use_is_refused(engine):
    data_dir = engine.workdir / "jobs"
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--port", "0", "--data-dir", str(data_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.splitlines() == [f"launch.py: error: data dir {data_dir} is in use by another engine (it holds "
                                     f"{data_dir / 'lock'}): pass another --data-dir"]


@pytest.mark.heavy  # three engine starts
def test_engines_with_default_flags_on_two_ports_each_keep_their_own_jobs(tmp_path, monkeypatch):
    """No --data-dir: each engine takes the dir of the address it serves, below $DISAGG_DATA_DIR (here a temp
    root); a restart on the same port finds its jobs again."""
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "root"))
    image = {"prompt": "a red kite", "size": "32x16", "num_inference_steps": 1, "seed": 4}

    def listed(e):
        return [i["id"] for i in e.http.get("/v1/images").json()["data"]]

    a = EngineProcess("tiny", workdir=tmp_path / "a", own_data_dir=False)
    try:
        with EngineProcess("tiny", workdir=tmp_path / "b", own_data_dir=False) as b:
            made = a.http.post("/v1/images/generations", json=image)
            assert made.status_code == 200, made.text
            ids = listed(a)
            assert len(ids) == 1 and listed(b) == []
            assert b.http.post("/v1/images/generations", json=image).status_code == 200
            assert len(listed(b)) == 1 and listed(b) != ids and listed(a) == ids
        port = a.port
    finally:
        a.stop()
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == sorted(
        [f"127.0.0.1-{port}", f"127.0.0.1-{b.port}"])
    with EngineProcess("tiny", workdir=tmp_path / "again", own_data_dir=False, port=port) as again:
        assert listed(again) == ids


@pytest.mark.heavy
def test_a_restart_keeps_finished_jobs_and_runs_unfinished_ones_again(tmp_path, lora_root, tiny_lora):
    data_dir = tmp_path / "jobs"
    flags = ["--data-dir", str(data_dir), "--weight-root", str(lora_root)]
    first = EngineProcess("tiny", extra=flags, workdir=tmp_path / "first")
    try:
        done = [_settled_job(first, _create(first, prompt=p, seed=i)["id"]) for i, p in enumerate(["one", "two"])]
        mp4s = [first.http.get(f"/v1/videos/{v['id']}/content").content for v in done]
        r = first.http.post("/v1/load_lora_adapter", json={"lora_name": "style", "lora_path": str(tiny_lora.path)})
        assert r.status_code == 200, r.text
        slow = {"size": "64x64", "num_inference_steps": 300}
        running = _create(first, prompt="three", **slow)
        styled = _create(first, prompt="four", lora_name="style", **slow)
        before = first.http.get("/v1/videos", params={"order": "asc"}).json()["data"]
        assert [v["status"] for v in before[2:]] != ["completed"] * 2
    finally:
        first.stop()
    second = EngineProcess("tiny", extra=[*flags, "--max-jobs", "4"], workdir=tmp_path / "second")
    try:
        after = second.http.get("/v1/videos", params={"order": "asc"}).json()["data"]
        assert after[:2] == before[:2] == done  # the finished ones: every field as before
        assert [v["id"] for v in after] == [v["id"] for v in before]
        assert [second.http.get(f"/v1/videos/{v['id']}/content").content for v in done] == mp4s
        again = _settled_job(second, running["id"], timeout_s=300)
        assert again["status"] == "completed" and again["created_at"] == running["created_at"]
        gone = _settled_job(second, styled["id"])
        assert gone["status"] == "failed" and gone["error"]["code"] == "engine_restarted"
        assert "lora_name: no adapter 'style' is loaded" in gone["error"]["message"]
        r = second.http.post("/v1/videos", json={"prompt": "five", **FAST})
        assert r.status_code == 429 and r.json()["error"]["type"] == "too_many_jobs"  # --max-jobs 4 still holds
    finally:
        second.stop()
