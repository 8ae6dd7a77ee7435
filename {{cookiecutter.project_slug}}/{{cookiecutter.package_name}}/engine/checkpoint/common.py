"""What both kinds of checkpoint share: the checks on --ckpt-dir and on options changed since the checkpoint,
the lease that keeps one job per folder, durable renames, and the save / resume protocol of a Checkpointer (its
subclasses write and read the files)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..collectives import all_gather_objects, all_reduce, from_first_rank_with
from ..distributed import DistEnv
from ..errors import NonFiniteTraining, UsageError
from ..flags import flag, option
from ..optimizers import group_settings, member_optimizers, take_built_settings
from ..replicas import check_replicas_match, sync_buffers_from_main
from ..reproducibility import restore_rng_states
from .folder import CONFIG_RECORD, LEASE_FILE, write_text

log = logging.getLogger(__name__)
BACKGROUND_WRITE = "checkpoint-write"  # the thread of an --async-save write, which a process lets finish


@dataclass
class CheckpointOptions:
    """The flags of checkpoints: where they go, how often, how many stay."""

    ckpt_dir: str = option("checkpoints", "checkpoints go here; training resumes from the newest one")
    ckpt_every: int = option(500, "save a checkpoint every this many optimizer steps (and at the end)")
    keep_checkpoints: int = option(2, "keep the newest this many checkpoints, delete older ones")
    async_save: bool = option(
        False, "write checkpoints in a thread while training goes on: the state (DDP: the writing rank's; FSDP2: "
        "every rank's shards) is copied to host memory, written, then published; the next save and the last "
        "wait for it. Costs that copy in host memory during each write")
    resume_changed_state: bool = option(
        False, "resume from a checkpoint whose entries differ from what this code saves (state added to or "
        "removed from build_checkpointer in train.py, fields added to TrainingProgress): new entries start "
        "fresh, entries this code no longer saves are dropped, and both are logged. Without it such a "
        "checkpoint stops the job")


@dataclass(frozen=True)
class RecordedOptions:
    """The run's options as checkpoints keep them: recorded in each, compared on resume, written beside them."""

    values: dict[str, Any]  # every option by name, the task's included
    fixed: frozenset[str]  # those a checkpoint cannot be resumed under once changed (a model's width)
    config_text: Callable[[], str]  # CKPT_DIR/config.yaml, the --config file that runs this run again: made by the
    # writer (rank 0) alone, as it writes it


def check_checkpoint_dir(ckpt_dir: str) -> None:
    """Create --ckpt-dir and prove it is writable, so a bad path fails now and not after hours of training."""
    try:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=ckpt_dir):
            pass
    except OSError as error:
        raise UsageError(f"--ckpt-dir {ckpt_dir} cannot be written ({error.strerror}); choose another folder") from None


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type where it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# torch's line for one tensor of another shape, in load_state_dict's error.
SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[.*?\])\) from "
                           r"checkpoint, the shape in current model is torch\.Size\((\[.*?\])\)")


def checkpoint_mismatch(path: Path, error: Exception) -> UsageError:
    """The one line for a checkpoint that loads but does not fit what this run built: torch's first line and its
    first two details (which key, which shapes), each shortened, and how many more."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    what = lines[0].rstrip(":") if lines else type(error).__name__
    details = [f"{match[1]}: checkpoint {match[2]} vs model {match[3]}" if (match := SIZE_MISMATCH.search(line))
               else line.rstrip(".")[:160] for line in lines[1:]]
    if details:
        what += ": " + "; ".join(details[:2]) + (f"; and {len(details) - 2} more" if len(details) > 2 else "")
    return UsageError(f"{path} does not fit this model or optimizer ({what}); use another --ckpt-dir, or the code "
                      "and options it was trained with")


# What a changed option does to a resumed run, where that is not plain from its --help.
EFFECT_OF_CHANGING = {
    "epochs": "the LR schedule is re-planned over the new --epochs from this sample on, unless --max-steps sets "
              "the run's length",
    "lr": "the LR schedule continues from this sample towards the new peak",
    "lr_schedule": "the new schedule applies from this sample on",
    "warmup_steps": "the warmup is re-planned in steps of this run's size",
    "seed": "the rest of this epoch and later epochs draw another sample order",
    "batch_size": "this epoch continues with its unseen samples, in batches of the new size; the LR schedule "
                  "follows samples and continues unchanged",
    "grad_accum": "this epoch continues with its unseen samples, in steps of the new size; the LR schedule "
                  "follows samples and continues unchanged",
}
# Expected to change between runs of one job; not worth a line.
CHANGED_BY_EVERY_RESUME = ("max_steps", "stop_at_step", "ckpt_dir", "resume_changed_state")  # --max-steps: the lr
# schedule says what a new run length does


def check_resumed_options(saved: dict | None, recorded: RecordedOptions, source: Path) -> list[str]:
    """Stop on a changed option the checkpoint cannot take; log the others in one line with their effect,
    and return them (--lr 0.01 -> 0.02, ...)."""
    if not saved:  # a checkpoint from before options were recorded
        return []
    current = recorded.values
    changed = [name for name, value in current.items()
               if name in saved and saved[name] != value and name not in CHANGED_BY_EVERY_RESUME]
    fixed = [name for name in changed if name in recorded.fixed]
    if fixed:
        was = ", ".join(f"--{flag(name)} {saved[name]}" for name in fixed)
        asked = ", ".join(f"--{flag(name)} {current[name]}" for name in fixed)
        raise UsageError(f"{source} was trained with {was}, but this run asks for {asked}; "
                         "resume with the same values, or start a new run with another --ckpt-dir")
    changes = [f"--{flag(name)} {saved[name]} -> {current[name]}" for name in changed]
    if changes:
        log.info("resuming with changed options: %s", "; ".join(
            change + (f" ({EFFECT_OF_CHANGING[name]})" if name in EFFECT_OF_CHANGING else "")
            for change, name in zip(changes, changed, strict=True)))
    return changes




def hold_checkpoint_folder(ckpt_dir: Path, env: DistEnv, device: torch.device, holder: bool):
    """One job per --ckpt-dir: `holder` ranks (one per storage, the checkpoint writers) lock <ckpt-dir>/.lease
    for the life of their process, with fcntl.flock, which works on local disks, NFSv4 and Lustre mounted with
    -o flock. A second job on the folder (a resubmission while the first still runs, two people with the
    default folder) would delete the first's save in progress, write the same step-<N> and prune the other's;
    it stops here instead, with one line naming the holder. The kernel releases the lock when the holding
    process ends, however it ends, so a killed job never blocks the next one. A collective: call on every rank.

    A lease held under this job's own run id is this job's earlier process: a restart's predecessor still being
    ended, or, after a Slurm requeue (same run id, restart count 0), a process on a machine that failed, whose
    lock NFSv4 keeps until the client's lease expires (90 s by default; Lustre until eviction). It is waited
    for, SAME_RUN_PATIENCE at most, then the attempt fails as a fault of the machine (retried by torchrun,
    requeued by the scheduler), never as a usage error, which would end the job for good.

    Returns the open lease (keep it open) on a holder, None elsewhere."""
    lease, problem = None, None
    if holder:
        lease, problem = take_lease(ckpt_dir / LEASE_FILE, env)
    problem = from_first_rank_with(problem, device)  # every rank stops, or none
    if problem and problem[1]:
        raise LeaseStillHeld(problem[0])
    if problem:
        raise UsageError(problem[0])
    return lease


SAME_RUN_PATIENCE = 150.0  # seconds: past NFSv4's default lease of 90 s


class LeaseStillHeld(OSError):
    """This job's own earlier process still holds --ckpt-dir's lease: a fault, retried, never a usage error."""


def take_lease(path: Path, env: DistEnv):
    """(the open lease, None) or (None, (why it is held, whether by this job's own run id: a fault))."""
    lease = open(path, "a+")  # noqa: SIM115 - held open as long as this process lives
    started, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):  # ENOLCK: a filesystem without locks
                log.warning("cannot lock %s (%s), so another job on this folder would not be stopped",
                            path, error.strerror)
                return lease, None
            lease.seek(0)
            try:
                held = json.loads(lease.read())
            except ValueError:  # its holder is still writing it
                held = {}
            holder = ", ".join(f"{key} {held[key]}" for key in ("run_id", "host", "pid", "since") if key in held)
            this_run = env.launched_by_torchrun and held.get("run_id") == env.run_id
            waited = time.monotonic() - started
            if this_run and waited < SAME_RUN_PATIENCE:
                if waited > 2 and not told:
                    told = True
                    log.warning("--ckpt-dir %s is locked by this job's own earlier process (%s): one on a machine "
                                "that failed keeps an NFS lock until its lease expires; waiting up to %.0f s",
                                path.parent, holder, SAME_RUN_PATIENCE)
                time.sleep(0.2)
                continue
            lease.close()
            if this_run:
                return None, (f"--ckpt-dir {path.parent} is still locked by this job's own earlier process "
                              f"({holder}) after {SAME_RUN_PATIENCE:.0f} s; retrying, as after any fault", True)
            return None, (f"--ckpt-dir {path.parent} is in use by another job ({holder or 'holder unknown'}); "
                          "wait for it to end, or give this job another --ckpt-dir", False)
    if told:
        log.warning("--ckpt-dir %s: the lock was released after %.0f s; going on", path.parent,
                    time.monotonic() - started)
    lease.seek(0)
    lease.truncate()
    lease.write(json.dumps({"run_id": env.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    lease.flush()
    return lease, None


def check_finite(model: torch.nn.Module, step: int) -> None:
    """Stop rather than save a model with a NaN or inf parameter or floating-point buffer (BatchNorm statistics,
    which a forward on a skipped NaN batch has already moved), so the newest checkpoint, and every one that
    retention keeps, holds a finite model. A collective (under FSDP2 each rank sees its own shards): one small
    all-reduce."""
    tensors = [(name, tensor.to_local() if hasattr(tensor, "to_local") else tensor)  # FSDP2: this rank's shard
               for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_floating_point()]
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(tensor.detach()).all() for _, tensor in tensors])
    if not all_reduce((~finite).any().int().reshape(1), "max").item():
        return
    mine = next((name for (name, _), ok in zip(tensors, finite.tolist(), strict=True) if not ok), None)
    name = next(found for found in all_gather_objects(mine) if found is not None)
    raise NonFiniteTraining(f"step {step}: {name!r} of the model is not finite (NaN or inf); not saved, so the "
                            "checkpoints hold only finite models. Resume from the newest one with a lower --lr, or "
                            "--clip-grad")


# Names a checkpoint holds besides the components and progress's fields (a DDP file at its top level, a DCP
# folder's "progress" entry): no component and no field of train.py's TrainingProgress may take one.
RESERVED_NAMES = {"world_size", "entries", "options", "progress", "torch_rng_state", "cpu_rng_states",
                  "cuda_rng_states"}


class Checkpointer:
    """Saving and resuming, whichever files hold the state. `components` are what a checkpoint holds besides
    progress: anything with state_dict/load_state_dict (model, optimizer, lr schedule, gradient scaler). Add
    yours where train.py calls build_checkpointer. A component whose state is spread over the ranks (each rank's
    place in a stream) also has gather_from_ranks(), called on every rank before each save (a collective).

    A subclass writes one step (`write`) and finds and reads the newest valid one (`find_newest`, `read`);
    saving once per step, the order of restoring and the log lines are here."""

    def __init__(self, options: CheckpointOptions, recorded: RecordedOptions, env: DistEnv, device: torch.device,
                 **components):
        self.options = options
        self.recorded = recorded  # the run's options, recorded in every checkpoint and compared on resume
        self.changed_options: list[str] = []  # by the resume: --lr 0.01 -> 0.02, ...
        self.resumed_from: tuple[int, dict] | None = None  # the checkpoint's world size and options, on resume
        self.ckpt_dir = Path(options.ckpt_dir)
        self.keep = options.keep_checkpoints
        self.env = env
        self.device = device
        if "model" not in components:
            raise UsageError("build_checkpointer needs the unwrapped model as model=...; name everything else as "
                             "you like")
        reserved = sorted(set(components) & RESERVED_NAMES)
        if reserved:  # a DDP checkpoint is one flat dict: such an entry would be overwritten, silently
            raise UsageError(f"build_checkpointer: an entry named {reserved[0]!r}, a name checkpoints keep for "
                             f"themselves ({', '.join(sorted(RESERVED_NAMES))}); rename it")
        self.components = components
        self.progress_type: type | None = None  # train.py's TrainingProgress, which resume() is given first
        self.last_saved: tuple | None = None  # what tells two saves of one step apart
        self._writing: threading.Thread | None = None  # --async-save's write in progress
        self._write_error: BaseException | None = None  # what it raised, for wait() to raise

    def save(self, progress: Any, wait: bool = False) -> None:
        """A collective: every rank saves at the same steps. `wait`: return only once the save is on disk
        (--async-save otherwise writes in a thread while training goes on), as the last save of a job must.
        A step saved already is saved again only if an evaluation changed what it holds since."""
        saved_as = self.saved_as(progress)
        if saved_as != self.last_saved:  # not, e.g., the final save right after a periodic one
            self.last_saved = saved_as
            started = time.perf_counter()
            check_replicas_match(self.components["model"], progress.step)  # never save one rank's model of several
            check_finite(self.components["model"], progress.step)  # nor a NaN one
            for component in self.components.values():  # state spread over ranks (each rank's place in a stream)
                if hasattr(component, "gather_from_ranks"):
                    component.gather_from_ranks()
            sync_buffers_from_main(self.components["model"])  # one canonical copy of BatchNorm statistics
            written = self.write(progress)
            if written is not None:
                log.info("saved %s in %.2f s%s", written, time.perf_counter() - started,
                         " (a copy in memory: writing it in the background)" if self._writing else "")
        if wait:
            self.wait()

    def in_background(self, write: Callable[..., None], *args) -> None:
        """Run `write(*args)` in a thread (--async-save); wait() joins it and raises what it raised."""
        def run() -> None:
            try:
                write(*args)
            except BaseException as error:  # noqa: BLE001 - raised on the training thread by wait()
                self._write_error = error
        self._writing = threading.Thread(target=run, name=BACKGROUND_WRITE)
        self._writing.start()

    def wait(self) -> None:
        """Until the save this rank is writing in the background (--async-save) is on disk; raises its error if
        it failed."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise error

    def saved_as(self, progress: Any) -> tuple:
        """What an evaluation changes without a step: the loop's progress (an evaluation due or done) and the state
        of a component that judges evaluations (kept_step: the best checkpoint's). Alike on every rank."""
        return asdict(progress), [component.state_dict() for component in self.components.values()
                                  if hasattr(component, "kept_step")]

    def kept_steps(self) -> set[int]:
        """Steps whose checkpoints retention keeps besides the newest: a component's kept_step (the best one)."""
        return {step for component in self.components.values()
                if (step := getattr(component, "kept_step", None)) is not None}

    def resume(self, progress_type: type) -> Any:
        """Load the newest valid checkpoint into the components (a collective) and return where the loop stood: a
        `progress_type` (train.py's TrainingProgress, a dataclass) with its saved fields; a fresh one if none."""
        self.progress_type = progress_type  # what each save writes the fields of, and a resume reads back
        clashing = {spec.name for spec in fields(progress_type)} & (set(self.components) | RESERVED_NAMES)
        if clashing:  # a DDP checkpoint is one flat dict: such a field would overwrite an entry, silently
            raise UsageError(f"{progress_type.__name__} in train.py has a field named {', '.join(sorted(clashing))}, "
                             "like a checkpoint entry; rename it")
        newest = self.find_newest()
        if newest is None:
            log.info("no valid checkpoint in %s; starting from scratch", self.ckpt_dir)
            self.record_config()
            return progress_type()
        source, saved_options = newest
        self.changed_options = check_resumed_options(saved_options, self.recorded, source)
        entries, progress_fields = self.saved_entries(source)
        restored = self.check_saved_entries(source, entries, progress_fields)
        optimizers = [member for name, component in self.components.items() if name in restored
                      and isinstance(component, torch.optim.Optimizer) for member in member_optimizers(component)]
        built = [group_settings(optimizer) for optimizer in optimizers]  # before the load restores the saved ones
        try:
            state = self.read(source, restored)
            for name in self.components:  # in the order given, the same on every rank (a load may be a collective)
                if name in restored and name not in self.restored_by_read:
                    self.components[name].load_state_dict(state[name])
            self.own_what_was_loaded(state)
            settings = [take_built_settings(optimizer, as_built)
                        for optimizer, as_built in zip(optimizers, built, strict=True)]
        except (RuntimeError, ValueError, KeyError) as error:
            raise checkpoint_mismatch(source, error) from None
        if changed := [change for changes, _ in settings for change in changes]:
            log.info("the optimizer's settings are this run's, not the checkpoint's: %s", ", ".join(changed))
        if kept := [key for _, keys in settings for key in keys]:
            log.warning("the optimizer keeps the checkpoint's %s, which differ from what this run built: it may "
                        "keep state of its own there", ", ".join(kept))
        restore_rng_states(state, self.env, self.device)
        self.record_config()  # once the resume was accepted: a refused one leaves the record as it was
        saved = state["progress"]
        progress = progress_type(**{spec.name: saved[spec.name] for spec in fields(progress_type)
                                    if spec.name in progress_fields})
        self.last_saved = self.saved_as(progress)
        log.info("resuming from %s (step %d, epoch %d, %d samples into the epoch, %d in all, saved by %d ranks)",
                 source, progress.step, progress.epoch, progress.samples_in_epoch, progress.samples_seen,
                 saved["world_size"])
        self.resumed_from = (saved["world_size"], saved_options or {})
        if saved["world_size"] != self.env.world_size:
            log.info("%d ranks instead of %d: a step is now another number of samples; the lr schedule follows "
                     "samples seen and continues unchanged, %s", self.env.world_size, saved["world_size"],
                     "and so does the run's length: --max-steps counts steps of the first world size")
        return progress

    def record_config(self) -> None:
        """This run's options beside its checkpoints, as a --config file (rank 0)."""
        if self.env.rank == 0:
            write_text(self.ckpt_dir / CONFIG_RECORD, self.recorded.config_text())

    def check_saved_entries(self, source: Path, entries: set[str], progress_fields: set[str]) -> set[str]:
        """The components to restore from `source`. A checkpoint that does not hold what this code saves (state
        added to or removed from build_checkpointer, a field added to TrainingProgress) loads but cannot be
        resumed exactly: stop with one line, unless --resume-changed-state says to go on without them."""
        new = sorted(self.components.keys() - entries) + [
            f"{self.progress_type.__name__}.{spec.name}" for spec in fields(self.progress_type)
            if spec.name not in progress_fields]
        gone = sorted(entries - self.components.keys())
        if not (new or gone):
            return set(self.components)
        difference = "; ".join(part for part in (
            f"this code saves {', '.join(new)}, which it lacks" if new else "",
            f"it holds {', '.join(gone)}, which this code no longer saves" if gone else "") if part)
        if not self.options.resume_changed_state:
            raise UsageError(f"{source} does not hold what this code saves: {difference}. Resume with the code "
                             "that wrote it, or pass --resume-changed-state once to start the new entries fresh "
                             "from it and drop the others")
        log.warning("--resume-changed-state: %s; new entries start fresh, the others are dropped", difference)
        return set(self.components) & entries

    def saved_entries(self, source: Path) -> tuple[set[str], set[str]]:
        """(names of the components `source` holds, names of the TrainingProgress fields it holds)."""
        raise NotImplementedError

    restored_by_read: frozenset[str] = frozenset()  # components read() restores itself

    def write(self, progress: Any) -> Path | None:
        """Write this step (a collective); returns what was written, on the rank that logs it."""
        raise NotImplementedError

    def find_newest(self) -> tuple[Path, dict | None] | None:
        """(checkpoint, the options it recorded) of the newest valid one, the same on every rank."""
        raise NotImplementedError

    def own_what_was_loaded(self, state: dict) -> None:
        """After the components loaded `state`: make sure none of them keeps a tensor of it (a mapped file)."""

    def read(self, source: Path, components: set[str]) -> dict:
        """The state of `source`: the named components' state_dicts, torch_rng_state, cpu_ and cuda_rng_states,
        and progress (the fields of train.py's TrainingProgress, and world_size)."""
        raise NotImplementedError
