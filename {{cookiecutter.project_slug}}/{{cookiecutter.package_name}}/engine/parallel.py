"""Data parallelism for the model: DDP replicas or FSDP2 shards (and torch.compile on top), and gradient-sync
control for accumulation. (The buffer sync and the check that DDP's replicas are one model: engine/replicas.py.)"""

from __future__ import annotations

import contextlib
import functools
import logging
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import UsageError
from .replicas import is_sharded

log = logging.getLogger(__name__)


def wrap_model(model: torch.nn.Module, device: torch.device, strategy: str = "ddp", compile_model: bool = False,
               param_dtype: torch.dtype | None = None, activation_checkpointing: str = "none",
               find_unused_parameters: bool = False) -> torch.nn.Module:
    """The module to run forward and backward through, compiled when asked, its blocks' activations recomputed
    in the backward pass when asked (--activation-checkpointing: checkpoint_activations).

    ddp: DDP replicas over the already-placed model (none for a single rank); save, load and evaluate the
    unwrapped `model`. find_unused_parameters: a step may leave some parameters without a gradient (a mixture of
    experts, a conditional branch); DDP then looks for them after every forward (Task.find_unused_parameters).
    fsdp2: `model` itself, its parameters sharded in place (each rank holds 1/world_size of them).
    One plain process: the model itself.
    """
    if strategy == "fsdp2" and find_unused_parameters:  # FSDP2 reduce-scatters only what has a gradient
        raise UsageError("Task(find_unused_parameters=True) is DDP's: under FSDP2 a parameter without a gradient on "
                         "some rank makes the ranks' reduce-scatters differ, a hang or wrong gradients "
                         "(pytorch/pytorch#158719); use --strategy ddp, or let every step use every parameter")
    checkpoint_activations(model, activation_checkpointing)  # before wrapping: FSDP2's hooks then run around it
    if dist.is_initialized() and strategy == "fsdp2":
        shard_model(model, param_dtype)
    elif dist.is_initialized() and dist.get_world_size() > 1:  # one rank: DDP would only copy gradients
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            # Gradients are views into the all-reduce buckets: no copy in or out of them, less memory.
            gradient_as_bucket_view=True,
            find_unused_parameters=find_unused_parameters,
            # static_graph stays off: with it, a model whose forward returns an object DDP cannot look into (a
            # plain dataclass, not a registered pytree node) has its gradients never all-reduced, without an
            # error, and each rank trains a model of its own (pytorch/pytorch#106690). check_replicas_match
            # would stop such a job, but what static_graph saves is small (DDP's per-step search for unused
            # parameters runs only with find_unused_parameters=True).
        )
    if compile_model:
        # Compiling the DDP module lets dynamo split graphs at bucket boundaries, keeping the all-reduce
        # overlapped with the backward pass.
        model = torch.compile(model)
    return model


def wrap_networks(model: nn.Module, device: torch.device, strategy: str = "ddp", compile_model: bool = False,
                  param_dtype: torch.dtype | None = None, activation_checkpointing: str = "none",
                  one_by_one: bool = False, find_unused_parameters: bool = False) -> SimpleNamespace:
    """What training runs forward and backward through, by name: the whole model wrapped (networks.model), or
    with one_by_one (a task with its own training_step) each top-level module of `model` that has trained
    parameters wrapped on its own, the others as they are (networks.generator). Networks stepped in turn each run
    their own forward and backward, and DDP all-reduces a network's gradients only when its own forward ran before
    the backward (wrapping the whole model, the network left out of a forward would stop the next step: DDP's
    unused-parameters error). The model itself still holds the unwrapped networks: checkpoints and evaluation see it
    unchanged."""
    wrap = functools.partial(wrap_model, device=device, strategy=strategy, compile_model=compile_model,
                             param_dtype=param_dtype, activation_checkpointing=activation_checkpointing,
                             find_unused_parameters=find_unused_parameters)
    if not one_by_one:
        return SimpleNamespace(model=wrap(model))
    own = [name for name, parameter in model.named_parameters(recurse=False) if parameter.requires_grad]
    if own:
        raise UsageError(f"Task(training_step=...) trains the model's top-level modules, each wrapped on its own, "
                         f"but parameter {own[0]!r} belongs to the model itself; put it in one of its modules")
    return SimpleNamespace(**{
        name: wrap(network) if any(parameter.requires_grad for parameter in network.parameters()) else network
        for name, network in model.named_children()})


def checkpoint_activations(model: nn.Module, which: str) -> None:
    """--activation-checkpointing full or every-N: each chosen block (of shardable_blocks, the ones FSDP2 shards)
    keeps only its inputs in the forward pass and runs forward again in the backward pass, for the activations
    its gradients need. torch.utils.checkpoint, non-reentrant, as torchtitan applies it: it runs under DDP and
    FSDP2 (whose hooks all-gather the block again for the recomputation), and in eager mode it restores the
    CPU and CUDA generators first, so dropout draws the same masks and the gradients are those without it, bit
    for bit (under --compile the compiler replays dropout's randomness itself). The block's forward is replaced
    on the instance, so parameter names, and with them checkpoints and exports, stay as they are."""
    blocks = blocks_to_checkpoint(model, which)
    if not blocks:
        return
    from torch.utils.checkpoint import checkpoint

    names = {module: name for name, module in model.named_modules()}
    for block in blocks:
        # The recomputation runs the forward a second time in training mode: running statistics would move twice.
        tracked = [names[module] for module in block.modules()
                   if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats]
        if tracked:
            raise UsageError(f"--activation-checkpointing {which}: block {names[block] or 'the model'} holds "
                             f"BatchNorm {tracked[0]}, whose running statistics the recomputation in the backward "
                             "pass would update a second time; use --activation-checkpointing none with this "
                             "model, or a norm without running statistics (LayerNorm, GroupNorm)")
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    log.info("activation checkpointing: %d of %d blocks recompute their activations in the backward pass (%s)",
             len(blocks), len(shardable_blocks(model)), ", ".join(names[block] for block in blocks[:8])
             + (", ..." if len(blocks) > 8 else ""))


def blocks_to_checkpoint(model: nn.Module, which: str) -> list[nn.Module]:
    """The blocks --activation-checkpointing names: none, all of shardable_blocks (full), or every Nth."""
    if which == "none":
        return []
    every = 1 if which == "full" else int(which.removeprefix("every-"))
    return shardable_blocks(model)[every - 1::every]


def shard_model(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """fully_shard each block, then the root: a block's parameters are all-gathered just before its forward
    and freed after, so only one block is ever whole. Gradients are reduce-scattered in fp32."""
    # fully_shard refuses non-contiguous parameters, which channels-last conv weights are. Inputs stay
    # channels-last, and a convolution with one channels-last operand still runs the NHWC kernels.
    from torch.distributed.fsdp import fully_shard  # here: importing FSDP costs every rank's start half a second

    model.to(memory_format=torch.contiguous_format)
    for block in shardable_blocks(model):
        fully_shard(block, mp_policy=precision_policy(block, param_dtype))
    # The root holds what no block does (stem, head); its outputs return in fp32 for the loss.
    fully_shard(model, mp_policy=precision_policy(model, param_dtype, output_dtype=torch.float32))
    groups = sum(is_sharded(module) for module in model.modules())
    log.info("fsdp2: %d groups, one all-gather each per forward and per backward", groups)
    if groups == 1:  # nothing to shard block by block: every rank holds the whole model during each pass
        log.warning("fsdp2: no blocks to shard found, so the whole model is gathered on every rank for each "
                    "forward and backward; give the model a shardable_blocks() method returning its blocks")


def precision_policy(group: nn.Module, param_dtype: torch.dtype | None,
                     output_dtype: torch.dtype | None = None):
    """All-gather a group's parameters in param_dtype, except for a group holding a BatchNorm: its weights must
    match its fp32 running statistics, so the group keeps fp32 parameters and the autocast around the forward
    runs its convolutions in the lower precision, as under DDP. (A group of its own per BatchNorm would cost
    ResNet-50 53 more all-gathers each forward and backward.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if holds_batchnorm(group):
        param_dtype = None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=output_dtype)


def holds_batchnorm(group: nn.Module) -> bool:
    """Whether a BatchNorm's parameters would be in this group (not in an already sharded sub-group)."""
    if isinstance(group, nn.modules.batchnorm._BatchNorm):
        return True
    return any(holds_batchnorm(child) for child in group.children() if not is_sharded(child))


def shardable_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard: what the model's shardable_blocks() returns if it has one (the GPT of the language
    model task: its transformer blocks), else the members of its top-level Sequentials, ModuleLists and
    ModuleDicts (ResNet's residual blocks, a ViT's encoder layers, small_cnn's blocks, adapters by name; fully_shard
    refuses a container without a forward of its own) and its other top-level children."""
    if hasattr(model, "shardable_blocks"):
        return list(model.shardable_blocks())
    blocks = []
    for child in model.children():
        is_container = isinstance(child, nn.Sequential | nn.ModuleList | nn.ModuleDict)  # no forward of its own
        members = list(child.children()) if is_container else [child]
        blocks += [member for member in members if any(True for _ in member.parameters())]
    return blocks


@contextlib.contextmanager
def whole_model(model: nn.Module, keep: bool = True):
    """Gather an FSDP2 model's parameters whole (every rank takes part) and, where `keep`, keep them through
    forwards, so that this rank can run the model alone: each forward would otherwise all-gather, and wait for
    ranks that are not running it. Sharded again after. A model not sharded: as it is."""
    sharded = [module for module in model.modules() if is_sharded(module)]
    # Private attributes, the same from torch 2.6 on; torch has no getter for what reshard_after_forward set.
    states = [module._get_fsdp_state() for module in sharded]
    groups = [group for state in states for group in getattr(state, "_fsdp_param_groups", None)
              or [state._fsdp_param_group] if group is not None]
    if not all(hasattr(group, "post_forward_mesh_info") for group in groups):
        raise RuntimeError("this torch's FSDP2 keeps its reshard-after-forward setting elsewhere: whole_model (in "
                           "parallel.py) cannot keep a model gathered for one rank")
    kept = [group.post_forward_mesh_info for group in groups]  # None: not resharded after a forward
    # Each forward also appends to the order the next backward prefetches in; rank 0's alone would make it
    # all-gather alone there (FSDP2 clears them at the end of a backward only).
    recorded = [len(group._post_forward_indices) for group in groups]
    orders = {id(group.comm_ctx): (order, len(order)) for group in groups
              if (order := getattr(group.comm_ctx, "post_forward_order", None)) is not None}
    for module in sharded:
        module.unshard()
        if not keep:  # this rank only took part in the all-gather
            module.reshard()
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        yield model
    finally:
        for group, mesh_info, count in zip(groups, kept, recorded, strict=True):
            group.post_forward_mesh_info = mesh_info
            del group._post_forward_indices[count:]
        for order, count in orders.values():
            del order[count:]
        for module in sharded:
            module.reshard()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's whole value: FSDP2 gives some (a gradient norm) as a DTensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradient_sync(training_model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap a micro-step's forward and backward: with enabled=False, gradients accumulate locally and the
    all-reduce is skipped; the step that finally syncs all-reduces the accumulated sum once."""
    module = getattr(training_model, "_orig_mod", training_model)  # under torch.compile
    if enabled:
        return contextlib.nullcontext()
    if is_sharded(module):
        return fsdp_gradient_sync_off(module)
    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def fsdp_gradient_sync_off(module: nn.Module):
    """FSDP2's no_sync: gradients stay unsharded and local until a backward with sync on."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def uses_channels_last(model: torch.nn.Module, device: torch.device, requested: bool | None) -> bool:
    """NHWC suits tensor-core convolutions on CUDA; on CPU it rarely helps, so there it is opt-in."""
    if requested is not None:
        return requested
    return device.type == "cuda" and any(isinstance(module, torch.nn.Conv2d) for module in model.modules())
