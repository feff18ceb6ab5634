"""Move one large tensor from one process to another: ZeroMQ frames vs the shared-memory data plane.

    python bench/transfer.py [--sizes 1 16 64 256] [--repeats 7] [--json FILE]

In one run, for each size (MiB, float32):

* ``copy_``: an in-memory copy into a preallocated tensor in this process (the yardstick);
* ``clone``: an in-memory copy into fresh memory (what making a new tensor costs);
  both time small copies back to back (64 MiB per sample) so that thread wake-ups do not dominate;
* ``zmq``: ``common.protocol.codec.encode`` -> ZeroMQ PUSH over ``ipc://`` -> ``decode_frames`` in a second process
  (a child started with ``subprocess``; only the codec's msgpack header and raw bytes cross);
* ``shm new``: the same with the codec's shared-memory sender and receiver (``common.transport.shm``): the
  sender writes the tensor into a new ``/dev/shm`` segment (``write(2)``), the receiver maps it;
* ``shm prepared``: the same, with a segment of that size prepared ahead of time by the sender's
  ``SparePool`` (what the engine does for sizes it sends repeatedly); the sender copies into it.
  Each round waits until the background thread has the spare ready, as a transfer between two
  requests' compute would find it; that preparation is not in the timing.

With ``--device cuda`` (a GPU host) the tensor starts on the GPU and must end on the GPU in the
receiver: ``copy_`` and ``clone`` are device copies, the zmq and shm modes stage through host memory
(device -> host in the sender, host -> device in the receiver, what a GPU-to-GPU hop costs without
CUDA IPC), and a ``cuda ipc`` mode sends a CUDA IPC handle (``common.transport.cuda_ipc``): the receiver copies
from the sender's GPU memory into its own.

Times run from just before ``encode`` in the sender until the receiver holds a usable tensor
("usable": decoded, a view over the frame or the mapping) and until it has also read every byte
once ("read once": ``tensor.sum()``); both ends read ``CLOCK_MONOTONIC``, which is system-wide.
The receiver drops the tensor (munmap / free) before the next round starts, outside the timing.
Medians over ``--repeats`` rounds after one warm-up round. GB/s is 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.transport.cuda_ipc import CudaIpcReceiver, CudaIpcSender  # noqa: E402
from common.protocol.messages import PROTOCOL_VERSION, Result  # noqa: E402
from common.transport.shm import ShmReceiver, ShmSender, SparePool, engine_prefix, remove_engine_segments  # noqa: E402
from common.protocol.codec import decode_frames, encode  # noqa: E402

RECEIVER = "bench-rx"
MiB = 1 << 20


def clock() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def endpoints(work: Path) -> tuple[str, str]:
    return f"ipc://{work / 'data.sock'}", f"ipc://{work / 'report.sock'}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(work: Path, device: torch.device) -> None:
    """Receiver: decode each message, note when the tensor is usable and when it has been read once."""
    data_ep, report_ep = endpoints(work)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(data_ep)
    push = ctx.socket(zmq.PUSH)
    push.connect(report_ep)
    receiver = ShmReceiver(engine_prefix(str(work)), RECEIVER)
    cuda = CudaIpcReceiver(device) if device.type == "cuda" else None
    push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id="ready", stage="bench")))
    while True:
        frames = pull.recv_multipart(copy=False)
        msg, tensors = decode_frames(frames, shm=receiver, cuda=cuda)
        if msg.request_id == "stop":
            break
        x = tensors["x"].to(device)  # host-staged modes on a GPU: the host -> device half of the hop
        sync(device)
        usable = clock()
        float(x.sum())
        read = clock()
        del x
        del tensors, frames  # teardown (munmap / free) happens here, before the report
        push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage="bench",
                                          info={"usable": usable, "read": read})))
    pull.close(0)
    push.close(0)
    ctx.term()


def median_time(fn, repeats: int, inner: int) -> float:
    """Median seconds of one ``fn()``, each sample timing ``inner`` calls back to back."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256], help="MiB")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads in both processes (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: the tensor starts and ends on this GPU")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no GPU")
    if args.child:
        child(Path(args.child), device)
        return

    work = Path(tempfile.mkdtemp(prefix="transfer-"))
    os.chmod(work, 0o700)
    prefix = engine_prefix(str(work))
    data_ep, report_ep = endpoints(work)
    ctx = zmq.Context()
    report = ctx.socket(zmq.PULL)
    report.bind(report_ep)
    push = ctx.socket(zmq.PUSH)
    push.connect(data_ep)
    pool = SparePool(prefix, "bench-tx", max_bytes=max(args.sizes) * MiB)
    senders = {"zmq": None, "shm_new": ShmSender(prefix, RECEIVER, threshold=1),
               "shm_prepared": ShmSender(prefix, RECEIVER, threshold=1, spares=pool)}
    cuda = {"cuda_ipc": CudaIpcSender(RECEIVER)} if device.type == "cuda" else {}
    senders.update(dict.fromkeys(cuda))
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(work), "--threads", str(args.threads),
                             "--device", args.device], cwd=ROOT)
    try:
        if not report.poll(60_000):
            raise SystemExit("receiver did not start")
        report.recv_multipart()
        rows = []
        for mib in args.sizes:
            n = mib * MiB
            src = torch.randn(n // 4, device=device)
            dst = torch.empty_like(src)
            row = {"MiB": mib, "torch_threads": torch.get_num_threads(), "device": str(device)}
            inner = max(1, 64 // mib)  # small copies back to back, so that thread wake-ups do not dominate
            row["copy_"] = n / median_time(lambda: (dst.copy_(src), sync(device)), args.repeats, inner) / 1e9
            row["clone"] = n / median_time(lambda: (src.clone(), sync(device)), args.repeats, inner) / 1e9
            for mode, shm in senders.items():
                usable, read = [], []
                warmup = 2 if shm is not None and shm.spares is not None else 1  # the pool learns the size
                for i in range(args.repeats + warmup):
                    rid = f"{mode}-{mib}-{i}"
                    if i >= warmup and shm is not None and shm.spares is not None:
                        if not pool.wait_ready(n, 60):
                            raise SystemExit(f"no prepared segment of {mib} MiB")
                    t0 = clock()
                    push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id=rid, stage="bench"),
                                               {"x": src}, shm=shm, cuda=cuda.get(mode)), copy=False)
                    if not report.poll(120_000):
                        raise SystemExit(f"no report for {rid}")
                    msg, _ = decode_frames(report.recv_multipart())
                    assert msg.request_id == rid
                    if i >= warmup:
                        usable.append(msg.info["usable"] - t0)
                        read.append(msg.info["read"] - t0)
                row[f"{mode}_usable"] = n / statistics.median(usable) / 1e9
                row[f"{mode}_read"] = n / statistics.median(read) / 1e9
            rows.append(row)
            print(f"{mib} MiB done", file=sys.stderr, flush=True)
        push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id="stop", stage="bench")))
        proc.wait(timeout=30)
    finally:
        pool.close()
        if proc.poll() is None:
            proc.kill()
        push.close(0)
        report.close(0)
        ctx.term()
        left = remove_engine_segments(prefix)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nsegments left after the run (removed): {left}")
    print(f"one tensor between two processes on {device}, median of {args.repeats}, GB/s "
          f"(ratio to copy_ in parentheses; torch threads {rows[0]['torch_threads']})\n")
    cols = ["clone", "zmq_usable", "zmq_read", "shm_new_usable", "shm_new_read", "shm_prepared_usable",
            "shm_prepared_read"] + [f"{m}_{k}" for m in cuda for k in ("usable", "read")]
    print("| size | copy_ | " + " | ".join(c.replace("_", " ").replace("read", "read once") for c in cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f} ({r[k] / r['copy_']:.2f})" for k in cols)
        print(f"| {r['MiB']} MiB | {r['copy_']:.2f} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
