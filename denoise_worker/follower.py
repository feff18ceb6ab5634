"""A follower rank of a multi-device denoise worker.

``python -m denoise_worker.follower --config F --index N --rank R``.

Started by its leader (:mod:`denoise_worker.ranks`), never by hand. It loads
the same experts on its own device, joins the worker's group, takes its part of
the layout (:class:`~denoise_worker.parallel_forward.ParallelLayout`) and runs
its share of every call the leader sends until the leader stops it. It has no
socket: only the leader talks to the rest of the engine.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist

from common.config.engine import EngineConfig, worker_threads, torch_dtype_for
from common.diffusion.compiled import compile_experts
from common.families import read_model
from common.diffusion.policy import Policy
from denoise_worker.parallel_forward import Follower, ParallelLayout
from denoise_worker.ranks import die_with_parent, join_group

log = logging.getLogger("disagg.follower")


def main() -> None:
    p = argparse.ArgumentParser(description="disagg-diffusion denoise follower rank (started by its leader)")
    p.add_argument("--config", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args()
    die_with_parent()
    config = EngineConfig.load(args.config)
    spec = config.worker("denoise", args.index)
    logging.basicConfig(level=os.environ.get("DISAGG_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s denoise-{spec.index}.{args.rank} %(levelname)s %(message)s")
    torch.set_num_threads(worker_threads(config, spec))
    device = torch.device(spec.devices[args.rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = read_model(config.model, config.transformer_file)
    policy = Policy.load(info, torch_dtype_for(device.type, config.dtype), device)
    join_group(config, spec, args.rank)
    try:
        layout = ParallelLayout.of(spec, device.type)
        layout.prepare(policy)
        if config.compile:  # compiled by the leader's warm-up forwards, which reach every rank
            policy.share_text()
            compile_experts(policy)
        log.info("rank %d of %d ready on %s", args.rank, spec.ranks, device)
        forwards = Follower(policy, layout, device).run()
        log.info("rank %d stops after %d forwards", args.rank, forwards)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
