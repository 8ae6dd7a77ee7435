"""What a run tells its user in words: rank-0 log lines, the job it joined, launch pitfalls (numbers: metrics.py)."""

from __future__ import annotations

import logging

import torch

from .distributed import DistEnv, backend_for

log = logging.getLogger("train")


def setup_logging(env: DistEnv) -> None:
    """INFO on rank 0 only; other ranks report warnings and errors, prefixed with their rank."""
    prefix = "" if env.is_main_process else f"[rank {env.rank}] "
    logging.basicConfig(
        level=logging.INFO if env.is_main_process else logging.WARNING,
        format=f"%(asctime)s.%(msecs)03d {prefix}%(message)s", datefmt="%H:%M:%S", force=True,
    )


def describe_job(env: DistEnv, device: torch.device) -> str:
    return (f"world_size={env.world_size} nodes={env.num_nodes} ranks_per_node={env.local_world_size} "
            f"backend={backend_for(device)} device={device} run_id={env.run_id} restart={env.restart_count}")
