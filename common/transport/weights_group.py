"""A standalone torch.distributed group between a trainer (rank 0, which hosts the store) and the denoise
workers, for broadcasting weights: not torch.distributed's default group, so it never meets any other use
of torch.distributed in either process."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def broadcast_options(root: int = 0) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


def store(address: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The group's rendezvous: the trainer hosts it, each worker connects to it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if is_master:
        return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)


def new_group(tcp_store, rank: int, world_size: int, backend: str, timeout_s: float):
    """A gloo (CPU tensors) or NCCL (GPU tensors) group over ``tcp_store``; returns once every rank joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(tcp_store, rank, world_size, timeout)
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("this torch build has no NCCL; use gloo")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(tcp_store, rank, world_size, options)
