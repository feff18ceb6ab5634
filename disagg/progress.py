"""A tqdm bar over a request's real denoising steps, read from the engine's ``GET /progress/{id}``."""

from __future__ import annotations

import threading

import httpx
from tqdm import tqdm

POLL_S = 0.1


class StepBar:
    """Polls the request's progress in a thread while the caller waits for its answer (``with StepBar(...)``).

    The bar's total is the step count the denoise worker reports (or ``steps`` when the caller knows it), its
    description the stage the request is in.
    """

    def __init__(self, url: str, headers: dict[str, str], request_id: str, steps: int | None):
        self._http = httpx.Client(base_url=url, headers=headers, timeout=5.0)  # its own: clients are per thread
        self._path = f"/progress/{request_id}"
        self._bar = tqdm(total=steps, desc="encode", unit="step")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "StepBar":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._http.close()
        self._bar.close()

    def finish(self) -> None:
        """The answer came: every step was taken, whatever the last poll saw."""
        self._stop.set()
        self._thread.join()
        if self._bar.total is not None:
            self._bar.update(self._bar.total - self._bar.n)
        self._bar.set_description("done")

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                r = self._http.get(self._path)
                state = r.json() if r.status_code == 200 else None  # 404 before admission and once answered
            except (httpx.HTTPError, ValueError):
                continue  # the answer (or its error) says what went wrong; the bar only shows progress
            if state is None:
                continue
            if state["steps"] and self._bar.total != state["steps"]:
                self._bar.total = state["steps"]
            self._bar.set_description(state["stage"], refresh=False)
            self._bar.update(state["step"] - self._bar.n)
