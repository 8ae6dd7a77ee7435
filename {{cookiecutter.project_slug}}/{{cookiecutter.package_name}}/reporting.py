"""What a run tells its user: rank-0 log lines with loss (averaged over ranks), lr and throughput."""

from __future__ import annotations

import logging
import time

import torch

from .distributed import DistEnv, backend_for, mean_across_ranks

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


class TrainingMeter:
    """Accumulates loss on the device between log lines, so logging costs one all-reduce per interval,
    not a host sync per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.steps = 0
        self.samples = 0
        self.started = time.perf_counter()

    def update(self, loss: torch.Tensor, global_batch_size: int) -> None:
        self.loss_sum += loss.detach()
        self.steps += 1
        self.samples += global_batch_size

    def log_and_reset(self, step: int, epoch: int, lr: float) -> float:
        """Log the mean loss over ranks and steps since the last line; returns it."""
        loss = mean_across_ranks(self.loss_sum / max(self.steps, 1))
        samples_per_second = self.samples / (time.perf_counter() - self.started)
        log.info("step %d | epoch %d | loss %.4f | lr %.2e | %.1f samples/s",
                 step, epoch, loss, lr, samples_per_second)
        self.reset()
        return loss

