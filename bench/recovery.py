"""Worker crash recovery: time from SIGKILL to the in-flight error, and to a fully ready engine.

    python bench/recovery.py [--repeats 3]

Starts ``encoder=1,denoise=2,decode=1`` on the tiny model; for each role, keeps
slow requests in flight, kills the busiest worker of that role, and measures
when the requests it held got their 503, when ``/health`` is 200 again, and
that requests on the other routes succeeded meanwhile.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from router.client import EngineClient, EngineHTTPError  # noqa: E402

SLOW = dict(height=128, width=128, num_frames=9, num_inference_steps=300, output_type="frames")


def one_kill(eng: EngineProcess, role: str) -> dict:
    results: list[tuple[str, float]] = []

    def call(i: int) -> None:
        try:
            with EngineClient(eng.url) as c:
                c.generate(f"r{i}", seed=i, **SLOW)
            results.append(("ok", time.monotonic()))
        except EngineHTTPError as e:
            results.append((f"{e.status}:{e.error.get('stage')}", time.monotonic()))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # Kill while the requests are in the chosen stage.
    deadline = time.monotonic() + 30
    victim = None
    while time.monotonic() < deadline and victim is None:
        rows = [w for w in eng.http.get("/health").json()["workers"] if w["role"] == role]
        busy = max(rows, key=lambda w: w["outstanding"])
        if busy["outstanding"] and (role != "decode" or time.monotonic() > deadline - 27):
            victim = busy
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join()
    errors = [t - killed for s, t in results if s != "ok"]
    while eng.http.get("/health").status_code != 200:
        time.sleep(0.05)
    return {"role": role, "errors": len(errors), "ok": sum(1 for s, _ in results if s == "ok"),
            "first_error_s": min(errors) if errors else None, "ready_s": time.monotonic() - killed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    # One attempt: the requests a dead worker held fail (503), which is what this measures; bench/chaos.py
    # measures them answered again.
    with EngineProcess("tiny", "encoder=1,denoise=2,decode=1", extra=["--max-attempts", "1"]) as eng:
        for role in ("denoise", "decode", "encoder"):
            for _ in range(args.repeats):
                rows.append(one_kill(eng, role))
    print(f"\n{'killed':<8} {'kills':>5} {'in-flight failed':>16} {'others ok':>9} "
          f"{'kill -> 503 s (median)':>23} {'kill -> ready s (median)':>25}")
    for role in ("denoise", "decode", "encoder"):
        rs = [r for r in rows if r["role"] == role]
        firsts = [r["first_error_s"] for r in rs if r["first_error_s"] is not None]
        print(f"{role:<8} {len(rs):>5} {sum(r['errors'] for r in rs):>16} {sum(r['ok'] for r in rs):>9} "
              f"{statistics.median(firsts) if firsts else float('nan'):>23.3f} "
              f"{statistics.median(r['ready_s'] for r in rs):>25.2f}")


if __name__ == "__main__":
    main()
