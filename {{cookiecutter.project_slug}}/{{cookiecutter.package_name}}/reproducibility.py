"""Random state and kernel choice: seeding, the per-rank CUDA generators a checkpoint carries, and whether
cuDNN may pick its convolution algorithms by timing them."""

from __future__ import annotations

import os

import torch

from .distributed import DistEnv, all_reduce_sum
from .options import TrainOptions


def seed_and_choose_kernels(options: TrainOptions, env: DistEnv, device: torch.device) -> None:
    """The CPU generator gets --seed on every rank: model initialisation must be identical everywhere (FSDP2
    shards each rank's own copy). Each rank's CUDA generator gets a seed of its own, so GPU dropout draws
    different masks on different ranks, as it would on different samples of one large batch."""
    torch.manual_seed(options.seed)
    if device.type != "cuda":
        return
    with torch.cuda.device(device):
        torch.cuda.manual_seed(cuda_seed(options.seed, env.rank))
    if options.deterministic:
        # Bitwise-repeatable GPU kernels, for comparing runs (e.g. a resumed one against an uninterrupted one).
        # warn_only: ops with no deterministic variant (adaptive pooling's backward) warn instead of failing.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, not before
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        # Fixed image shapes: time cuDNN's algorithms once per shape, then use the fastest.
        torch.backends.cudnn.benchmark = True


def cuda_seed(seed: int, rank: int) -> int:
    """A rank's CUDA seed: from --seed and the rank alone, so a rank that resumes without a saved state (the job
    grew) starts from a reproducible one."""
    return (seed * 1_000_003 + rank) % 2**63


def gather_cuda_rng_states(env: DistEnv, device: torch.device) -> list[list[int]]:
    """Every rank's CUDA generator state, indexed by rank (empty lists without CUDA). A collective: each rank
    fills its own row of a zero table and the all-reduce sum completes it on every rank. Plain lists of ints,
    so the .pt file loads with weights_only=True and DCP stores the list whole, whatever the world size."""
    if device.type != "cuda":
        return [[] for _ in range(env.world_size)]
    own = torch.cuda.get_rng_state(device)
    table = torch.zeros(env.world_size, own.numel(), dtype=torch.int64, device=device)
    table[env.rank] = own.to(device=device, dtype=torch.int64)
    return all_reduce_sum(table).tolist()


def restore_cuda_rng_state(states: list[list[int]] | None, env: DistEnv, device: torch.device) -> None:
    """Continue this rank's CUDA generator where the checkpoint left it. Nothing to do without CUDA, for a
    checkpoint saved without it, or for a rank the saving job did not have: that rank keeps its fresh seed."""
    if device.type != "cuda" or not states or env.rank >= len(states) or not states[env.rank]:
        return
    torch.cuda.set_rng_state(torch.tensor(states[env.rank], dtype=torch.uint8), device)
