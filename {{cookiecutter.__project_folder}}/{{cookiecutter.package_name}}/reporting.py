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


def warn_about_launch_pitfalls(env: DistEnv) -> None:
    if env.store_shared_across_restarts and env.is_main_process:
        log.warning("torchrun shares its TCPStore across restarts, so a restarted group may hang "
                    "(pytorch/pytorch#135712); launch with run_node.sh, or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")


def describe_job(env: DistEnv, device: torch.device) -> str:
    return (f"world_size={env.world_size} nodes={env.num_nodes} ranks_per_node={env.local_world_size} "
            f"backend={backend_for(device)} device={device} run_id={env.run_id} restart={env.restart_count}")
