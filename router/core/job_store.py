"""Where ``/v1/videos`` jobs and recorded images outlive the router: SQLite rows plus one file per content.

A data dir holds ``jobs.sqlite3`` (one row per job), ``files/`` (each finished job's MP4 or PNG) and
``lock``, which the engine that uses the dir holds (``flock``) for its whole life, so that two engines never
write one table. A content file is written under a temporary name and renamed, and its row names it only
after that, so a crash never leaves a half file that lists as done. No sockets, no event loop: the
router calls this from its event loop thread (each call is one short statement) and writes files through
:meth:`JobStore.write_content` in a worker thread (it touches no SQLite).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

TMP_SUFFIX = ".tmp"  # a content file being written; never named by a row
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: what listing follows
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,                     -- video | image
    prompt TEXT NOT NULL,
    model TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    error TEXT,                             -- JSON {"code", "message"}
    request TEXT,                           -- JSON: the body fields that run the job again
    content TEXT                            -- the file under files/, once done
)"""


class DataDirInUse(RuntimeError):
    """Another engine holds the data dir's lock."""


@dataclass
class JobRow:
    """One job as stored (its request fields stay in the table: :meth:`JobStore.request_of`)."""

    id: str
    kind: str
    prompt: str
    model: str
    size: str
    status: str
    seconds: str | None = None
    progress: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None
    content: str | None = None


COLUMNS = tuple(f.name for f in fields(JobRow))
SELECT = f"SELECT {', '.join(COLUMNS)} FROM jobs"


def _row(values: tuple) -> JobRow:
    row = JobRow(*values)
    row.error = json.loads(row.error) if row.error else None
    return row


def _lock(data_dir: Path) -> int:
    fd = os.open(data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirInUse(f"data dir {data_dir} is in use by another engine (it holds {data_dir / 'lock'}): "
                           "pass another --data-dir") from None
    return fd


class JobStore:
    """The table and the files of one data dir, locked for this process while open."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir).expanduser().resolve()
        self.files = self.dir / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.dir)
        try:
            # check_same_thread off: the router opens the store before its event loop runs, then uses it
            # from that loop's thread only.
            self.db = sqlite3.connect(self.dir / "jobs.sqlite3", isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(SCHEMA)
        except BaseException:
            self.close()
            raise
        self.remove_strays()

    def close(self) -> None:
        if getattr(self, "db", None) is not None:
            self.db.close()
            self.db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    # --- rows ------------------------------------------------------------------------------
    def add(self, row: JobRow, request: dict | None = None) -> None:
        values = [getattr(row, c) for c in COLUMNS]
        values[COLUMNS.index("error")] = json.dumps(row.error) if row.error else None
        marks = ", ".join("?" * (len(COLUMNS) + 1))
        self.db.execute(f"INSERT INTO jobs ({', '.join(COLUMNS)}, request) VALUES ({marks})",
                        (*values, json.dumps(request) if request is not None else None))

    def update(self, job_id: str, **changes) -> None:
        """Set columns of one row (``error`` as a dict)."""
        if "error" in changes:
            changes["error"] = json.dumps(changes["error"]) if changes["error"] else None
        assert set(changes) <= set(COLUMNS) - {"id", "kind"}, changes
        self.db.execute(f"UPDATE jobs SET {', '.join(f'{c} = ?' for c in changes)} WHERE id = ?",
                        (*changes.values(), job_id))

    def get(self, job_id: str, kind: str) -> JobRow | None:
        values = self.db.execute(f"{SELECT} WHERE id = ? AND kind = ?", (job_id, kind)).fetchone()
        return _row(values) if values else None

    def request_of(self, job_id: str) -> dict | None:
        (text,) = self.db.execute("SELECT request FROM jobs WHERE id = ?", (job_id,)).fetchone() or (None,)
        return json.loads(text) if text else None

    def page(self, kind: str, after: str | None, limit: int, order: str) -> tuple[list[JobRow], bool]:
        """Up to ``limit`` rows of ``kind`` in creation order (newest first for ``desc``), after the row
        ``after`` (an id that is not there: an empty page); and whether more follow."""
        where, args = "kind = ?", [kind]
        if after is not None:
            seq = self.db.execute("SELECT seq FROM jobs WHERE id = ? AND kind = ?", (after, kind)).fetchone()
            if seq is None:
                return [], False
            where += " AND seq > ?" if order == "asc" else " AND seq < ?"
            args.append(seq[0])
        rows = self.db.execute(f"{SELECT} WHERE {where} ORDER BY seq {'ASC' if order == 'asc' else 'DESC'} "
                               "LIMIT ?", (*args, limit + 1)).fetchall()
        return [_row(v) for v in rows[:limit]], len(rows) > limit

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]

    def counts(self, kind: str) -> dict[str, int]:
        return dict(self.db.execute("SELECT status, COUNT(*) FROM jobs WHERE kind = ? GROUP BY status", (kind,)))

    def oldest_finished(self, kind: str) -> JobRow | None:
        values = self.db.execute(f"{SELECT} WHERE kind = ? AND completed_at IS NOT NULL ORDER BY seq LIMIT 1",
                                 (kind,)).fetchone()
        return _row(values) if values else None

    def unfinished(self, kind: str) -> list[JobRow]:
        return [_row(v) for v in self.db.execute(f"{SELECT} WHERE kind = ? AND completed_at IS NULL ORDER BY seq",
                                                 (kind,))]

    def expired(self, now: float) -> list[JobRow]:
        return [_row(v) for v in self.db.execute(f"{SELECT} WHERE expires_at <= ?", (now,))]

    def set_ttl(self, ttl_s: float) -> None:
        """Finished rows expire ``ttl_s`` after they finished: the engine's --job-ttl now, whatever it was."""
        self.db.execute("UPDATE jobs SET expires_at = CAST(completed_at + ? AS INTEGER) "
                        "WHERE completed_at IS NOT NULL", (ttl_s,))

    def delete(self, row: JobRow) -> None:
        """The row, then its file (a crash in between leaves a stray file, removed at the next open)."""
        self.db.execute("DELETE FROM jobs WHERE id = ?", (row.id,))
        if row.content:
            self.remove_file(row.content)

    # --- files -----------------------------------------------------------------------------
    def write_content(self, job_id: str, suffix: str, data: bytes) -> str:
        """Write ``data`` as ``files/<job_id><suffix>`` (temp file, fsync, rename); its name. Raises OSError
        (a full disk, a files dir gone). Blocking: call it from a worker thread."""
        name = f"{job_id}{suffix}"
        tmp = self.files / f"{name}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.files / name)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the error that matters is the one raised
            raise
        return name

    def remove_file(self, name: str) -> None:
        (self.files / name).unlink(missing_ok=True)

    def read_content(self, name: str) -> bytes:
        """Blocking: call it from a worker thread."""
        return (self.files / name).read_bytes()

    def remove_strays(self) -> None:
        """Files no row names: temp files of a write a crash interrupted, files of rows deleted just before
        a crash."""
        named = {n for (n,) in self.db.execute("SELECT content FROM jobs WHERE content IS NOT NULL")}
        for path in self.files.iterdir():
            if path.name not in named and path.is_file():
                path.unlink(missing_ok=True)


def open_or_exit(data_dir: str) -> JobStore:
    """The launcher's way in, before it loads anything: a dir in use (or unusable) ends the process in one
    line, as a taken port does."""
    try:
        return JobStore(data_dir)
    except DataDirInUse as e:
        sys.exit(f"launch.py: error: {e}")
    except (OSError, sqlite3.Error) as e:
        sys.exit(f"launch.py: error: cannot use --data-dir {data_dir}: {e}")
