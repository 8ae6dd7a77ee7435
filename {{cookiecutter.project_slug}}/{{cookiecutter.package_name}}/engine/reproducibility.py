"""Random state and kernel choice: seeding, the per-rank generators a checkpoint carries, and whether
cuDNN may pick its convolution algorithms by timing them."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .distributed import DistEnv


def seed_and_choose_kernels(seed: int, deterministic: bool, env: DistEnv, device: torch.device) -> None:
    """Every generator (CPU, CUDA) gets --seed on every rank: model initialisation must be identical everywhere,
    on either device (FSDP2 shards each rank's own copy); seed_per_rank follows once the model is built."""
    torch.manual_seed(seed)
    if device.type != "cuda":
        return
    if deterministic:
        # Bitwise-repeatable GPU kernels, for comparing runs (e.g. a resumed one against an uninterrupted one).
        # warn_only: ops with no deterministic variant (adaptive pooling's backward) warn instead of failing.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, not before
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        # Fixed image shapes: time cuDNN's algorithms once per shape, then use the fastest.
        torch.backends.cudnn.benchmark = True


def seed_per_rank(seed: int, env: DistEnv, device: torch.device, rank_0_too: bool = False) -> None:
    """Once the model is built: the CPU and CUDA generators get a seed of their own per rank, so what a loss or a
    forward draws (torch.randn noise, dropout masks) differs between ranks, as it would between the samples of
    one large batch; with one seed everywhere every rank would draw the same noise for its different samples.
    A draw every rank must make alike (which blocks LayerDrop skips: ranks that ran different blocks would wait
    for each other's gradients) takes a generator of its own, seeded from --seed and the step number. Rank 0
    keeps its generators as model building left them: one process draws what the plain script it was ported from
    (torch.manual_seed, build the model, train) draws; `rank_0_too` reseeds it as well."""
    if env.rank == 0 and not rank_0_too:
        return
    torch.default_generator.manual_seed(rank_seed(seed, env.rank))
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(rank_seed(seed, env.rank))


def rank_seed(seed: int, rank: int) -> int:
    """A rank's seed: from --seed and the rank alone, so a rank that resumes without a saved state (the job
    grew) starts from a reproducible one."""
    return (seed * 1_000_003 + rank) % 2**63


def gather_rng_states(env: DistEnv, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's CPU and CUDA generator states, a row per rank: {"cpu_rng_states": uint8 [ranks, 5056],
    "cuda_rng_states": uint8 [ranks, 16]} (no columns without CUDA), and rank 0's CPU state. Each rank draws its
    own numbers (seed_per_rank), so each rank's own state is saved, not the writer's. A collective: one
    all-gather of 5 KB a rank. One byte tensor, not lists of ints, which at 4,096 ranks made a save pickle 20
    million numbers (seconds), and so does every load."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.zeros(0, dtype=torch.uint8)
    mine = torch.cat([cpu, cuda]).to(device)
    table = torch.empty(env.world_size, mine.numel(), dtype=torch.uint8, device=device)
    if dist.is_initialized():
        dist.all_gather(list(table.unbind(0)), mine)  # into the table's rows
    else:
        table[0] = mine
    table = table.cpu()
    # torch_rng_state: rank 0's CPU state, the same value on every rank (DCP writes one rank's copy of it), for
    # code that reads only that.
    return {"cpu_rng_states": table[:, :cpu.numel()].clone(), "cuda_rng_states": table[:, cpu.numel():].clone(),
            "torch_rng_state": table[0, :cpu.numel()].clone()}


def as_generator_state(saved: torch.Tensor | list[int]) -> torch.Tensor:
    """A saved generator state as torch takes it: a row of bytes, or a list of ints (saved before rows were
    bytes)."""
    # A copy: a row of the table is a view into it, and torch.set_rng_state(view) crashes (SIGSEGV, torch 2.14).
    return saved.clone() if isinstance(saved, torch.Tensor) else torch.tensor(saved, dtype=torch.uint8)


def restore_rng_states(state: dict, env: DistEnv, device: torch.device) -> None:
    """Continue this rank's generators where the checkpoint left them. A rank the saving job did not have (the
    job grew) keeps its fresh seeds (seed_per_rank's); a checkpoint saved before per-rank CPU states were gives
    every rank the CPU state of the rank that wrote it (torch_rng_state)."""
    cpu_states, cuda_states = state.get("cpu_rng_states", []), state.get("cuda_rng_states", [])
    if env.rank < len(cpu_states):
        torch.set_rng_state(as_generator_state(cpu_states[env.rank]))
    elif not len(cpu_states):
        torch.set_rng_state(state["torch_rng_state"])
    if device.type == "cuda" and env.rank < len(cuda_states) and len(cuda_states[env.rank]):
        torch.cuda.set_rng_state(as_generator_state(cuda_states[env.rank]), device)
