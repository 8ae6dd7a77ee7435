"""Around the optimizer step: the non-finite guard, the check that a loss called the wrapped model, mixed
precision (autocast, and the gradient scaler fp16 needs), the learning-rate schedule (over samples seen: linear
warmup, then a decay) and the run's plan in steps. The optimizers are built in task.py, the step is written out
in train.py, and step.py's Step is what a task sees of it."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from .collectives import all_gather_objects, all_reduce
from .errors import NonFiniteTraining, UsageError
from .parallel import whole
from .replicas import is_sharded

if TYPE_CHECKING:  # for annotations only: the engine imports nothing around it
    from ..options import TrainOptions

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteGuard:
    """A NaN or inf loss on any rank, or gradient norm, is found before the optimizer step and handled the same
    way on every rank: the step is skipped (--skip-nonfinite N, up to N in a run) or the job stops, with one line
    naming the step, the ranks and the value. Before the check the ranks agree (a loss is one rank's own, and a
    NaN in a term whose gradient is empty, a head's loss on a batch without its labels, leaves every gradient
    finite): a 2-number all-reduce and one host sync a step. Under fp16 an inf gradient is the scaler's to skip
    (it lowers its scale); only the loss is checked there."""

    def __init__(self, allowed: int, amp: MixedPrecision, device: torch.device):
        self.allowed = allowed
        self.skipped = 0
        self.check_gradients = not amp.scaler.is_enabled()
        self.device = device
        self.loss_not_finite = torch.zeros((), dtype=torch.bool, device=device)  # since the last check

    def watch(self, loss: torch.Tensor) -> None:
        """Each micro-batch's loss, on the device (no host sync)."""
        self.loss_not_finite |= ~torch.isfinite(loss.detach()).all()

    def allows_update(self, step: int, grad_norm: torch.Tensor) -> bool:
        """Whether this step's update may run: True if every rank's loss and the gradient norm are finite; False
        if a non-finite one is skipped (its gradients are then the caller's to zero); else NonFiniteTraining."""
        grad_norm = whole(grad_norm)
        grads_bad = ~torch.isfinite(grad_norm.detach()) if self.check_gradients else torch.zeros((), dtype=torch.bool)
        mine = torch.stack([self.loss_not_finite, grads_bad.to(self.device)]).int()
        self.loss_not_finite = torch.zeros((), dtype=torch.bool, device=self.device)
        if not any(all_reduce(mine.clone(), "max").tolist()):
            return True
        losses = [rank for rank, flags in enumerate(all_gather_objects(mine.tolist())) if flags[0]]
        parts = ([f"the loss on rank{'s' if len(losses) > 1 else ''} {', '.join(map(str, losses[:8]))}"
                  f"{' and more' if len(losses) > 8 else ''}"] if losses else []) + \
                ([f"the gradient norm ({float(grad_norm):g})"] if bool(grads_bad) else [])
        what = f"{' and '.join(parts)} {'were' if len(parts) > 1 else 'was'} not finite"
        if self.skipped < self.allowed:
            self.skipped += 1
            log.warning("step %d: %s; skipped on every rank (%d of --skip-nonfinite %d)", step, what, self.skipped,
                        self.allowed)
            return False
        raise NonFiniteTraining(
            f"step {step}: {what}; stopped before its update, and the checkpoints hold only finite models. Find "
            f"the cause (a batch with nothing to predict, a learning rate too high), or run the same command "
            f"with --skip-nonfinite {self.allowed + 1} to skip such steps")


# The loop's own columns of a training row (metrics.py), which step.log cannot take.
RESERVED_LOG_NAMES = {"kind", "step", "restart", "loss", "grad_norm", "lr", "samples_seen", "step_time_s",
                      "data_wait_frac", "max_memory_gib", "mfu"}


def bypassed_forward(name: str, networks: int) -> str:
    """The one line for a loss that trains a network without calling it (Step.forward_called)."""
    what = "the model compute_loss was given" if networks == 1 else f"networks.{name}"
    return (f"the loss gave {what} gradients without calling it: it ran the plain model (step.model) or a method "
            "other than forward (such as model.decode(...)), and DDP and FSDP2 sync gradients only through forward, "
            "so under torchrun the ranks would train different models; call the model itself (model(batch)) and do "
            "that work in its forward")


def parameters_without_gradient(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """The names of the parameters these optimizers train that hold no gradient now."""
    trained = {id(parameter) for optimizer in optimizers for group in optimizer.param_groups
               for parameter in group["params"]}
    return [name for name, parameter in model.named_parameters()
            if id(parameter) in trained and parameter.requires_grad and parameter.grad is None]


def wrapper_lacks(networks: SimpleNamespace, error: AttributeError) -> UsageError | None:
    """What one process (the model unwrapped) reports as forward_called's line, for the same loss under DDP."""
    for name, network in vars(networks).items():
        wrapper = type(network).__name__
        asked = str(error).removeprefix(f"'{wrapper}' object has no attribute ").strip("'")
        inner = getattr(network, "module", getattr(network, "_orig_mod", network))
        if asked != str(error) and inner is not network and callable(getattr(inner, asked, None)):
                return UsageError(bypassed_forward(name, len(vars(networks))))  # a method of the model
    return None


@contextlib.contextmanager
def forward_called(networks: SimpleNamespace) -> Iterator[None]:
    """Around this run's first forward and backward: stop, in one plain process as under torchrun, when the loss
    gave a network's parameters gradients without calling that network (forward pre-hooks, removed after): it
    ran the plain model (step.model) or a method other than forward (model.decode(...)). DDP syncs gradients
    only through the wrapped network's forward: the ranks would train different models (under DDP, a method it
    lacks fails as an AttributeError instead). FSDP2's networks are left alone: their registered forward
    methods run no module hook, and parameters left sharded fail loudly in any other method."""
    watched = {name: network for name, network in vars(networks).items()
               if not is_sharded(getattr(network, "_orig_mod", network))}
    called = dict.fromkeys(watched, False)
    had_gradient = {name: {id(parameter) for parameter in network.parameters() if parameter.grad is not None}
                    for name, network in watched.items()}
    handles = [network.register_forward_pre_hook(lambda *_, name=name: called.__setitem__(name, True))
               for name, network in watched.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    for name, network in watched.items():
        if not called[name] and any(parameter.grad is not None and id(parameter) not in had_gradient[name]
                                    for parameter in network.parameters()):
            raise UsageError(bypassed_forward(name, len(vars(networks))))


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto: bf16 where the GPU computes it natively (Ampere and newer), else fp32."""
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(f"--precision bf16 but {torch.cuda.get_device_name(device)} has no bf16; use fp16")
        return requested
    if device.type == "cuda" and computes_bf16_natively(device):
        return "bf16"
    return "fp32"  # CPU autocast is correct but rarely faster, so it is opt-in there


def computes_bf16_natively(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) and newer, or ROCm. Not torch.cuda.is_bf16_supported(): by default it
    also counts emulation, which V100s and T4s have, and there bf16 is slower than fp32."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


class MixedPrecision:
    """Parameters, gradients and optimizer state stay fp32; autocast runs matmuls and convolutions in the
    lower precision. fp16's narrow range needs the loss scaled up before backward and the gradients
    unscaled before clipping and stepping (GradScaler); bf16 has fp32's range and needs no scaler."""

    def __init__(self, precision: str, device: torch.device):
        self.precision = precision
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """What FSDP2 all-gathers parameters in for compute (its shards stay fp32); None: unchanged."""
        return None if self.precision == "fp32" else DTYPES[self.precision]

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around training and evaluation forwards alike."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()  # empty unless fp16

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)


def warmup_then_decay(samples_seen: float, warmup_samples: int, total_samples: int, decay: str,
                      decay_fraction: float = 0.2) -> float:
    """lr multiplier once training has seen `samples_seen` samples: linear warmup to 1, then to 0 at
    `total_samples` by a cosine or a line, or constant 1, or (wsd: warmup-stable-decay) 1 until the run's last
    `decay_fraction`, then a line to 0."""
    if samples_seen < warmup_samples:
        return samples_seen / warmup_samples
    if decay == "constant":
        return 1.0
    if decay == "wsd":
        decay_start = max(total_samples * (1 - decay_fraction), warmup_samples)
        return min(max((total_samples - samples_seen) / max(total_samples - decay_start, 1), 0.0), 1.0)
    progress = min((samples_seen - warmup_samples) / max(total_samples - warmup_samples, 1), 1.0)
    return 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def check_coupled_batch(couples: str | None, keep: bool, model: torch.nn.Module, options: TrainOptions,
                        world_size: int, resumed_from: tuple[int, dict] | None, own_batches: bool = False) -> None:
    """Say what --grad-accum and a resize do to a loss that couples the samples of a batch (Task.loss_couples,
    or BatchNorm's statistics): a step of N micro-batches is N batches coupled apart, not one N times larger; and
    a resize changes a batch coupled across ranks. With `keep`, such a resize stops instead, naming the
    --batch-size that keeps it. `resumed_from`: (world size, options) of the checkpoint resumed, if any;
    `own_batches`: the task makes its batches (Task.batches), of its own sizes."""
    norms = [module for module in model.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
             and any(parameter.requires_grad for parameter in module.parameters())]  # not a frozen teacher's
    why = f"Task.loss_couples={couples!r}"
    if couples is None and norms:
        synced = isinstance(norms[0], torch.nn.SyncBatchNorm)
        couples, why = ("global_batch", "SyncBatchNorm") if synced else ("micro_batch", "BatchNorm")
    if couples is None:
        return
    coupled = options.batch_size * (world_size if couples == "global_batch" else 1)
    if own_batches:
        if options.grad_accum > 1:
            log.info("the loss couples the samples of a batch (%s): a step of --grad-accum %d is %d of the task's "
                     "batches, each coupled alone", why, options.grad_accum, options.grad_accum)
        return
    if options.grad_accum > 1:
        log.info("the loss couples the samples of a batch (%s): a step of --grad-accum %d is %d batches of %d "
                 "samples each coupled alone, not one of %d", why, options.grad_accum, options.grad_accum, coupled,
                 coupled * options.grad_accum)
    if couples != "global_batch" or resumed_from is None or resumed_from[0] == world_size:
        return
    saved_world_size, saved_options = resumed_from
    before = saved_options.get("batch_size", options.batch_size) * saved_world_size
    if before == coupled:
        return
    keeping = (f"--batch-size {before // world_size} keeps it" if before % world_size == 0 else
               f"no --batch-size keeps it on {world_size} ranks")
    line = (f"the loss couples the samples of every rank ({why}): {before} samples before ({saved_world_size} ranks), "
            f"{coupled} now ({world_size} x --batch-size {options.batch_size}), which changes the loss; {keeping}")
    if keep:
        raise UsageError(f"{line} (Task.keep_coupled_batch)")
    log.warning("%s", line)


class LearningRateSchedule:
    """The lr as a function of the samples trained on (all ranks together), not of the optimizer step.

    A step is --batch-size x --grad-accum x world size samples, so a job resumed on another number of ranks
    takes other steps over the same data; a schedule over steps (torch's LambdaLR, with the step count restored)
    would then stand at the wrong fraction of the run: going from 1 rank to 2 halves the steps left, and the
    cosine reaches 0 halfway through. Here the lr of every step is the schedule's value at the middle of that
    step's samples, the same at any world size.

    The schedule spans the run: --max-steps steps of the world size the run started with, saved as samples
    (`run_samples`, where the run ends: a resize changes the steps left, not where the run ends or the lr at any
    sample count); else --epochs, each epoch's own samples. A resume with another --max-steps re-plans from
    there, in one line; --stop-at-step pauses a run without touching its schedule. Taking a step's middle,
    neither the first update (warmup starts at 0) nor the last (cosine ends at 0) is wasted at lr 0.

    Saved in checkpoints: the run's length and the warmup's, in samples. --warmup-steps counts steps of the
    world size the run started with; a resume on another one keeps the warmup it started, unless --warmup-steps
    itself changed. The peak lr is not restored: it is what task.py's optimizer was built with in this run."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: TrainOptions, loader: Any):
        self.optimizer = optimizer
        self.peaks = [group["lr"] for group in optimizer.param_groups]
        self.logged_peak = options.lr  # the lr logged is --lr on the schedule, whatever each group's own is
        if any(peak != options.lr for peak in self.peaks):
            log.info("the logged lr is --lr (%g) on the schedule; the optimizer's %d param groups peak at %g to %g "
                     "(what build_optimizer gave them), each on the same schedule", options.lr, len(self.peaks),
                     min(self.peaks), max(self.peaks))
        self.decay, self.decay_fraction = options.lr_schedule, options.decay_fraction
        self.scale = 1.0  # Task.after_evaluation's lr_scale (reduce on plateau): the schedule times it
        self.last_set: list[float] | None = None  # what set_lr set: an lr set elsewhere since is said (once)
        self.said = False
        self.spans_steps = options.max_steps  # None: the run spans --epochs
        self.samples_per_step = loader.samples_per_step  # all ranks' (Task.batches': a mean)
        self.total_samples = (loader.samples_in_epochs(options.epochs) if options.max_steps is None
                              else loader.samples_in_steps(options.max_steps))  # all ranks'
        self.replanned = ""  # what a resume with another run length did to the schedule
        self.warmup_steps = options.warmup_steps
        self.warmup_samples = (self.total_samples // 20 if options.warmup_steps is None
                               else options.warmup_steps * self.samples_per_step)

    @property
    def run_samples(self) -> int | None:
        """The run's length in samples where --max-steps sets it, else None (--epochs)."""
        return self.total_samples if self.spans_steps is not None else None

    def set_lr(self, samples_seen: float) -> float:
        """Set every param group's lr to the schedule's at `samples_seen` samples (a step's middle), times
        Task.after_evaluation's lr_scale; returns --lr's (the one logged). An lr set elsewhere since the last
        call (a task's own rule) is said once, not rewritten silently."""
        multiplier = self.scale * warmup_then_decay(samples_seen, self.warmup_samples, self.total_samples,
                                                    self.decay, self.decay_fraction)
        groups = self.optimizer.param_groups
        changed = [index for index, (group, last) in enumerate(zip(groups, self.last_set or [], strict=False))
                   if group["lr"] != last]
        if changed and not self.said:
            log.warning("param group %d's lr was set to %g outside the lr schedule, which sets it again at every "
                        "step; scale it from Task.after_evaluation (its lr_scale), or choose --lr-schedule",
                        changed[0], groups[changed[0]]["lr"])
            self.said = True
        for group, peak in zip(groups, self.peaks, strict=True):
            group["lr"] = peak * multiplier
        self.last_set = [group["lr"] for group in groups]
        return self.logged_peak * multiplier

    def state_dict(self) -> dict:
        return {"warmup_steps": self.warmup_steps, "warmup_samples": self.warmup_samples,
                "spans_steps": self.spans_steps, "total_samples": self.total_samples}

    def load_state_dict(self, state: dict) -> None:
        if state.get("warmup_steps", "not saved") == self.warmup_steps:
            self.warmup_samples = state["warmup_samples"]
        saved_steps = state.get("spans_steps", "old")  # not saved: from when --max-steps only stopped a run
        if saved_steps == self.spans_steps or (saved_steps == "old" and self.spans_steps is None):
            if saved_steps not in (None, "old"):  # (--epochs' are counted again: a changed one re-plans)
                if state["total_samples"] != self.total_samples:  # another world size's steps
                    self.total_samples = state["total_samples"]  # in samples of the first world size's steps
                    log.info("this run is --max-steps %d steps of its first world size: it ends once %d samples are "
                             "trained, %d a step now", saved_steps, self.total_samples, self.samples_per_step)
            return
        if self.spans_steps is not None and isinstance(saved_steps, int):  # steps of the first world size's size
            self.total_samples = self.spans_steps * state["total_samples"] // saved_steps
        before = "--epochs" if not isinstance(saved_steps, int) else f"--max-steps {saved_steps}"
        now = "--epochs" if self.spans_steps is None else f"--max-steps {self.spans_steps}"
        old = " (a checkpoint from before --max-steps set the run's length)" if saved_steps == "old" else ""
        keep = f"; to keep the old one, pass {before} --stop-at-step N" if isinstance(saved_steps, int) else ""
        self.replanned = (f"the lr schedule spanned {before}{old}; it now spans {now} ({self.total_samples} "
                          f"samples), the lr from here on that curve{keep}")  # said once the limits are accepted


def planned_steps(options: TrainOptions, loader: Any, progress: Any, lr_schedule: LearningRateSchedule) -> int:
    """The step this run ends at, at this world size (the progress bar's end): once the schedule's `run_samples`
    are trained (--max-steps'), else after --epochs, each epoch's own steps; or at --stop-at-step. A limit the
    checkpoint already passed is refused (the run would end at once), before the schedule says what it became."""
    run_samples = lr_schedule.run_samples
    # (A resize's last step may end past run_samples by less than a step: that run is finished, not refused.)
    if run_samples is not None and progress.samples_seen >= run_samples + loader.samples_per_step:
        needed = math.ceil(progress.samples_seen * options.max_steps / run_samples)
        raise UsageError(f"--max-steps {options.max_steps} ends the run before the {progress.step} steps the "
                         f"checkpoint already holds; pass --max-steps {needed} or more to go on, or another "
                         "--ckpt-dir to start over")
    if options.stop_at_step is not None and options.stop_at_step < progress.step:
        raise UsageError(f"--stop-at-step {options.stop_at_step} is below the {progress.step} steps the checkpoint "
                         f"already holds; pass --stop-at-step {progress.step + 1} or more, or leave it out")
    if lr_schedule.replanned:
        log.info("%s", lr_schedule.replanned)
    end = (loader.steps_in_epochs(options.epochs) if run_samples is None
           else progress.step + loader.steps_to(run_samples, progress))
    return end if options.stop_at_step is None else min(end, options.stop_at_step)
