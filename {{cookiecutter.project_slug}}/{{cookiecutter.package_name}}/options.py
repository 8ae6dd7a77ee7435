"""TrainOptions: every knob of a run, one typed field each; the command line is built from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .engine.checkpoint import CheckpointOptions, RecordedOptions
from .engine.errors import UsageError
from .engine.flags import flag, option
from .engine.watchdog import WatchdogOptions


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing its usage and exiting, so a bad flag is reported
    once per job like any other usage error, not by every rank of every attempt."""

    def error(self, message: str):
        raise UsageError(f"{message}; see python train.py --help")


def group(kind: type, title: str):
    """A TrainOptions field holding one concern's options (a dataclass of option() fields); their flags are
    top-level (--ckpt-dir, not --checkpoint.ckpt-dir), under `title` in --help."""
    return field(default_factory=kind, metadata={"help": None, "group": title})


@dataclass
class LoggingOptions:
    """metrics.py{% if cookiecutter.use_trackers == "yes" %} and trackers.py{% endif %}: what rank 0 logs, how often, and where it sends it."""

    log_every: int = option(10, "log loss and throughput every this many steps (rank 0)")
    log_dir: str | None = option(
        None, "rank 0 writes LOG_DIR/metrics.jsonl (one JSON object per logged step and per evaluation), "
        "and with --tracker tensorboard its event files there")
{%- if cookiecutter.use_trackers == "yes" %}
    tracker: Literal["tensorboard", "wandb", "mlflow", "none"] = option(
        "tensorboard", "where rank 0 also sends each row: TensorBoard event files in --log-dir, or one "
        "Weights & Biases or MLflow run per job, continued by every restart (its id: CKPT_DIR/tracker.json)")
{%- else %}
    tracker: Literal["tensorboard", "none"] = option(
        "tensorboard", "whether rank 0 also writes each row as TensorBoard event files in --log-dir")
{%- endif %}
    progress_bar: bool | None = option(None, "tqdm progress bar on rank 0 (default: only when stderr is a terminal)")


@dataclass
class SelectionOptions:
    """selection.py: the best checkpoint by an evaluation metric, and early stopping."""

    keep_best: str | None = option(
        None, "METRIC:min or METRIC:max (loss:min, accuracy:max: a metric the evaluation reports): after each "
        "evaluation that closes an epoch (--eval-every) or an interval (--eval-every-steps) and beats every one "
        "before, save a checkpoint, which retention never deletes; CKPT_DIR/best.json names it (one at the run's end "
        "or at --stop-at-step in mid-interval is logged, not judged)"
{%- if cookiecutter.use_export == "yes" %}
        " and `export --best CKPT_DIR` writes it"
{%- endif %})
    early_stop_patience: int | None = option(
        None, "with --keep-best: end training after this many evaluations in a row without a better metric "
        "(decided by rank 0 for every rank; a resumed job goes on counting)")


{%- if cookiecutter.use_profiling == "yes" %}


@dataclass
class ProfilingOptions:
    """profiling.py: traces and memory snapshots."""

    profile_steps: str | None = option(
        None, "START:COUNT: a torch.profiler trace of COUNT optimizer steps from step START, one file per rank, "
        "LOG_DIR/profile/trace-rank-<RANK>.json (open it in ui.perfetto.dev); the watchdog allows them "
        "--io-timeout")
    memory_snapshot: bool = option(
        False, "CUDA: record the allocator's history from the start, and dump it to LOG_DIR/profile/"
        "memory-rank-<RANK>-step-<N>.pickle at the end of --profile-steps, and -out-of-memory.pickle on an "
        "out-of-memory error (open them in pytorch.org/memory_viz)")

    def check(self, log_dir: str | None) -> None:
        if self.profile_steps is not None and not (re.fullmatch(r"[1-9]\d*:[1-9]\d*", self.profile_steps) and log_dir):
            raise UsageError(f"--profile-steps must be START:COUNT, both >= 1 (e.g. 10:3), with --log-dir for the "
                             f"traces, got {self.profile_steps!r}" + ("" if log_dir else " and no --log-dir"))
        if self.memory_snapshot and not log_dir:
            raise UsageError("--memory-snapshot writes under --log-dir; give one")
{%- endif %}


@dataclass
class TrainOptions:
    """How to train, whatever is trained. What is trained has its own options (task.py's TaskOptions), in
    `task`; parse_options() makes one command line of both."""

    epochs: int = option(10, "passes over the training set")
    max_steps: int | None = option(
        None, "the run's length in optimizer steps, in place of --epochs: the lr warmup and decay span them and "
        "the run ends there, after as many epochs as they take (counted at the world size the run starts on)")
    stop_at_step: int | None = option(
        None, "stop after this optimizer step and save, the lr schedule unchanged: a run paused, resumed later "
        "with a larger value or without it")
    batch_size: int = option(64, "samples per rank per step (the task's collate makes them one batch); the global "
                             "batch is this times the world size")
    lr: float = option(0.01, "peak learning rate: task.py's build_optimizer starts from it, the schedule scales it")
    lr_schedule: Literal["cosine", "linear", "wsd", "constant"] = option(
        "cosine", "after warmup: a cosine or a line down to 0 at the run's end (--max-steps, else --epochs); wsd: "
        "stable, then a line to 0 over the run's last --decay-fraction; or constant")
    decay_fraction: float = option(0.2, "--lr-schedule wsd: the fraction of the run its lr decays over, at the end")
    warmup_steps: int | None = option(None, "optimizer steps of linear warmup (default: 5%% of the run)")
    grad_accum: int = option(
        1, "micro-batches per optimizer step; gradients are all-reduced once per step, so a step trains on "
        "--batch-size x world size x this samples: the update of one such batch only where samples are "
        "independent (not with BatchNorm or an in-batch contrastive loss: Task.loss_couples)")
    clip_grad: float | None = option(None, "clip the gradient norm to this before each step (default: no clipping)")
    skip_nonfinite: int = option(
        0, "optimizer steps whose loss or gradient norm is not finite (NaN, inf) on any rank to skip, in this run, "
        "before stopping; 0: stop at the first, before its update, with the last checkpoint intact")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", "autocast dtype; auto: bf16 on CUDA that supports it, else fp32. fp16 uses a gradient scaler")
    strategy: Literal["ddp", "fsdp2"] = option(
        "{{ cookiecutter.strategy }}", "ddp: a full model copy per rank, gradients all-reduced; "
        "fsdp2: parameters, gradients and optimizer state sharded across ranks (checkpoints become step-<N>/ "
        "folders of shards)")
    compile: bool = option(False, "torch.compile the model (the first steps are slow while it compiles)")
    channels_last: bool | None = option(
        None, "NHWC memory format for convolutional models (default: on for CUDA, off for CPU)")
    seed: int = option(0, "seed of model init (every rank alike), data order and fake data; then of each rank's "
                       "own draws (dropout, noise): rank 0 goes on from where model init left torch's generators, "
                       "as a plain script seeded with it would, the other ranks from seeds of their own")
    deterministic: bool = option(False, "bitwise-repeatable CUDA kernels, slower (cuDNN autotuning off); CPU runs "
                                 "are repeatable without it")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "auto: cuda:LOCAL_RANK when CUDA is available, else cpu")
    num_workers: int = option(2, "DataLoader worker processes per rank")
    eval_every: int = option(1, "evaluate on the held-out split every this many epochs and when training stops "
                                "(0: never)")
    eval_every_steps: int = option(
        0, "evaluate every this many optimizer steps instead of by epochs (and when training stops); 0: by "
        "--eval-every's epochs. Counts steps from the run's start, so a resume keeps the same evaluation steps")
    activation_checkpointing: str = option(
        "none", "none, full, or every-N: keep only the inputs of every (or every Nth) block of the model (the "
        "blocks FSDP2 shards) in the forward pass and recompute the rest in the backward pass: less memory for "
        "about a third more compute; non-reentrant, so dropout draws the same masks again")
    sample_log: str | None = option(
        None, "audit the data order: append each training-sample index this rank loads to "
        "SAMPLE_LOG/rank-<RANK>.txt (with --num-workers 0, exactly the samples trained on)
{%- if cookiecutter.use_streaming == "yes" %}; for a streamed "
        "training set, epoch:piece:index of each sample trained on
{%- endif %}")
{%- if cookiecutter.fault_tolerance == "torchft" %}
    replica_groups: int = option(
        0, "torchft: the job's replica groups (machines, a torchrun each, started by run_node.sh with "
        "REPLICA_GROUPS=N): a group that fails is restarted and heals from the others, which keep training "
        "(docs/replica-groups.md); 0: a failure restarts every rank from the newest checkpoint")
{%- endif %}
    # The options of each concern, read by the module of that concern alone: options.checkpoint.ckpt_every.
    checkpoint: CheckpointOptions = group(CheckpointOptions, "checkpoints")
    watchdog: WatchdogOptions = group(WatchdogOptions, "progress and hangs")
    logging: LoggingOptions = group(LoggingOptions, "logging")
    selection: SelectionOptions = group(SelectionOptions, "the best checkpoint")
{%- if cookiecutter.use_profiling == "yes" %}
    profiling: ProfilingOptions = group(ProfilingOptions, "profiling")
{%- endif %}
    task: Any = field(default=None, metadata={"help": None})  # task.py's TaskOptions, set by parse_options

    def check(self) -> None:
        """Reject values that cannot work, each with what to do instead."""
        checkpoint, watchdog, logging_, selection = self.checkpoint, self.watchdog, self.logging, self.selection
        at_least_one = {"epochs": self.epochs, "batch_size": self.batch_size, "grad_accum": self.grad_accum,
                        "ckpt_every": checkpoint.ckpt_every, "keep_checkpoints": checkpoint.keep_checkpoints,
                        "log_every": logging_.log_every}
        for name, value in at_least_one.items():
            if value < 1:
                raise UsageError(f"--{flag(name)} must be >= 1, got {value}")
        for name in ("max_steps", "stop_at_step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{flag(name)} must be >= 1 (or left out), got {getattr(self, name)}")
        if self.eval_every < 0:
            raise UsageError(f"--eval-every must be >= 0 (0: never), got {self.eval_every}")
        if self.eval_every_steps < 0:
            raise UsageError(f"--eval-every-steps must be >= 0 (0: evaluate by epochs), got {self.eval_every_steps}")
        if self.eval_every_steps and self.eval_every > 1:
            raise UsageError(f"--eval-every {self.eval_every} (epochs) and --eval-every-steps {self.eval_every_steps} "
                             "both set an interval; give one of them")
        if self.num_workers < 0:
            raise UsageError(f"--num-workers must be >= 0, got {self.num_workers}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if not 0 < self.decay_fraction <= 1:
            raise UsageError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.strategy == "fsdp2" and self.precision == "fp16":
            raise UsageError("--precision fp16 needs a gradient scaler that FSDP2 shards do not support here; "
                             "use --precision bf16 (or fp32) with --strategy fsdp2")
        for name in ("step_timeout", "io_timeout"):
            if not getattr(watchdog, name) > 0:
                raise UsageError(f"--{flag(name)} must be > 0 seconds, got {getattr(watchdog, name)}")
        if self.skip_nonfinite < 0:
            raise UsageError(f"--skip-nonfinite must be >= 0 (0: stop at the first), got {self.skip_nonfinite}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise UsageError(f"--clip-grad must be > 0 (or left out for no clipping), got {self.clip_grad}")
        if selection.keep_best is not None and not re.fullmatch(r"\S+:(min|max)", selection.keep_best):
            raise UsageError(f"--keep-best must be METRIC:min or METRIC:max (e.g. loss:min, accuracy:max), got "
                             f"{selection.keep_best!r}")
        if selection.keep_best is not None and not (self.eval_every or self.eval_every_steps):
            raise UsageError("--keep-best judges evaluations, which --eval-every 0 turns off; evaluate every epoch "
                             "or every few (--eval-every N), or every N steps (--eval-every-steps N)")
        if selection.early_stop_patience is not None and (
                selection.keep_best is None or selection.early_stop_patience < 1):
            raise UsageError("--early-stop-patience needs --keep-best METRIC:min|max (the metric it waits on) and a "
                             f"value >= 1, got {selection.early_stop_patience}")
{%- if cookiecutter.use_profiling == "yes" %}
        self.profiling.check(logging_.log_dir)
{%- endif %}
{%- if cookiecutter.fault_tolerance == "torchft" %}
        if self.replica_groups < 0 or (self.replica_groups and (self.strategy != "ddp" or self.compile)):
            raise UsageError(f"--replica-groups must be >= 0 (0: off) and needs --strategy ddp without --compile, "
                             f"got {self.replica_groups} with --strategy {self.strategy}"
                             f"{' --compile' if self.compile else ''}")
{%- endif %}
        if not re.fullmatch(r"none|full|every-[1-9]\d*", self.activation_checkpointing):
            raise UsageError("--activation-checkpointing must be none, full or every-N (N >= 1), got "
                             f"{self.activation_checkpointing!r}")


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to each flag's help, except where the help already says what its default means
    ("(default: no limit)" was followed by "(default: None)") and where the default is None: such a
    flag is off unless given, which "(default: None)" does not say any better."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or (action.help and "(default:" in action.help):
            return action.help
        return super()._get_help_string(action)


def build_parser(task_options: type, training_defaults: dict[str, Any]) -> argparse.ArgumentParser:
    """One command line for the task's options (first in --help) and the training options; training_defaults
    (Task.training_defaults) replace the defaults of training options that suit the task differently."""
    parser = ArgumentParser(
        description="Train a model (task.py); launch with torchrun or run_node.sh (see train.py).",
        formatter_class=DefaultsOnceFormatter,
    )
    concerns = training_concerns()
    training_names = {spec.name for *_, specs in concerns for spec in specs}
    clashes = {spec.name for spec in dataclasses.fields(task_options)} & training_names
    unknown = training_defaults.keys() - training_names
    if clashes or unknown:
        raise UsageError(f"task.py: {', '.join(sorted(clashes))} in TaskOptions would hide the training option of "
                         "that name; rename it" if clashes else
                         f"task.py: TASK's training_defaults names {', '.join(sorted(unknown))}, which are no training "
                         "options (see options.py)")
    sections = [("what is trained (task.py)", task_options, dataclasses.fields(task_options))]
    sections += [(title, kind, specs) for _, title, kind, specs in concerns]
    for title, kind, specs in sections:
        group, hints = parser.add_argument_group(title), typing.get_type_hints(kind)
        for spec in specs:
            default = training_defaults.get(spec.name, spec.default)
            kind, choices = argument_type(hints[spec.name])
            if kind is bool:  # --compile / --no-compile
                group.add_argument(f"--{flag(spec.name)}", dest=spec.name, action=argparse.BooleanOptionalAction,
                                   default=default, help=spec.metadata["help"])
                continue
            group.add_argument(f"--{flag(spec.name)}", dest=spec.name, type=kind, choices=choices,
                               default=default, help=spec.metadata["help"])
    files = parser.add_argument_group("experiments as files")
    files.add_argument("--config", metavar="FILE", help="a YAML (or .toml) file of options by name (lr: 0.0003), "
                       "as --print-config writes; flags given as well win over it")
    files.add_argument("--print-config", action="store_true",
                       help="print the resolved options as such a file and exit: --config with it runs the same run")
    # The deprecated torch.distributed.launch passed --local-rank; torchrun sets LOCAL_RANK instead.
    parser.add_argument("--local-rank", dest="deprecated_local_rank", type=int,
                        default=None, help=argparse.SUPPRESS)
    return parser


def training_concerns() -> list[tuple[str | None, str, type, list[dataclasses.Field]]]:
    """The training options by concern: (the TrainOptions attribute, None for the loop's own; the --help title;
    the dataclass; its option fields)."""
    own = [spec for spec in dataclasses.fields(TrainOptions) if spec.metadata.get("help")]
    return [(None, "training", TrainOptions, own)] + [
        (spec.name, spec.metadata["group"], spec.default_factory, list(dataclasses.fields(spec.default_factory)))
        for spec in dataclasses.fields(TrainOptions) if "group" in spec.metadata]


def argument_type(hint) -> tuple[type, list | None]:
    """(converter, choices) for a field's annotation: int, float, str, Literal[...], or X | None."""
    if typing.get_origin(hint) is Literal:
        return str, list(typing.get_args(hint))
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return argument_type(inner)
    return hint, None


def accept_underscores(argv: list[str]) -> list[str]:
    """--batch_size 8 and --batch_size=8 mean --batch-size 8 (the old launcher's --local_rank too)."""
    def normalize(token: str) -> str:
        if not token.startswith("--"):
            return token
        name, equals, value = token.partition("=")
        return name.replace("_", "-") + equals + value
    return [normalize(token) for token in argv]


def parse_options(argv: list[str] | None, task_options: type,
                  training_defaults: dict[str, Any] | None = None) -> TrainOptions:
    """Parse argv into checked TrainOptions, with the task's options (a TaskOptions) in .task; raises
    UsageError on values that cannot work. With --config FILE, the file's values replace the defaults and the
    command line wins over both; with --print-config, print the resolved options as such a file and exit."""
    parser = build_parser(task_options, training_defaults or {})
    argv = accept_underscores(sys.argv[1:] if argv is None else argv)
    config_file = parser.parse_known_args(argv)[0].config  # a bad flag is parse_args' to report, below
    if config_file:
        kinds = [task_options] + [kind for _, _, kind, _ in training_concerns()]
        optional = {name for kind in kinds for name, hint in typing.get_type_hints(kind).items()
                    if type(None) in typing.get_args(hint)}
        parser.set_defaults(**read_config(config_file, parser, optional))
    namespace = vars(parser.parse_args(argv))
    del namespace["config"]
    print_config = namespace.pop("print_config")
    if namespace.pop("deprecated_local_rank") is not None:
        logging.getLogger(__name__).warning(
            "--local-rank is ignored: torchrun sets LOCAL_RANK in the environment, which wins")
    def values(specs) -> dict[str, Any]:
        return {spec.name: namespace[spec.name] for spec in specs}
    (_, _, _, own), *groups = training_concerns()
    options = TrainOptions(**values(own), **{attribute: kind(**values(specs)) for attribute, _, kind, specs in groups},
                           task=task_options(**values(dataclasses.fields(task_options))))
    options.check()
    if print_config:
        if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
            print(config_text(options), end="")
        raise SystemExit(0)
    return options


def read_config(path: str, parser: argparse.ArgumentParser, may_be_none: set[str]) -> dict[str, Any]:
    """The options a --config file (YAML, or TOML) sets, by field name, each checked as its flag would be."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UsageError(f"--config {path} cannot be read ({error.strerror})") from None
    try:
        if path.endswith(".toml"):
            values = toml_loads(text)
        else:
            import yaml  # here: only a run with --config pays for importing it

            values = yaml.safe_load(text) or {}
    except Exception as error:  # noqa: BLE001 - yaml.YAMLError (an Exception) or tomllib's TOMLDecodeError
        raise UsageError(f"--config {path} is not valid {'TOML' if path.endswith('.toml') else 'YAML'}: "
                         f"{' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path} must map option names to values (lr: 0.0003), not hold a "
                         f"{type(values).__name__}")
    known = {action.dest: action for action in parser._actions if action.dest not in NOT_IN_A_CONFIG}
    checked = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise UsageError(f"--config {path}: unknown option '{key}'"
                             + (f"; did you mean '{close[0]}'?" if close else "; see python train.py --help"))
        action = known[name]
        if value is None:
            if name not in may_be_none:
                raise UsageError(f"--config {path}: {key} needs a value")
            checked[name] = None
            continue
        if (action.type is str or action.choices) and not isinstance(value, str):
            # YAML reads 10:3 as 603 and 0755 as 493: a value meant as text must not change on the way.
            raise UsageError(f"--config {path}: {key} is text; quote it ({key}: '{value}') so that YAML keeps it "
                             "as written")
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise UsageError(f"--config {path}: {key} must be true or false, got {value!r}")
            checked[name] = value
            continue
        try:  # the flag's own conversion and choices, as if given on the command line
            checked[name] = getattr(parser.parse_args([f"--{flag(name)}", str(value)]), name)
        except UsageError as error:
            raise UsageError(f"--config {path}: {error}") from None
    return checked


def toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


NOT_IN_A_CONFIG = ("help", "config", "print_config", "deprecated_local_rank")


def config_text(options: TrainOptions) -> str:
    """The resolved options as a --config file (YAML): `python train.py --config FILE` runs the same run."""
    import yaml

    def lines(values: dict[str, Any]) -> str:
        return "".join(yaml.safe_dump({name: value}, sort_keys=False) for name, value in values.items())
    text = ("# python train.py --config THIS_FILE runs with these options; a flag given as well wins over the file\n"
            "# what is trained (task.py)\n" + lines(dataclasses.asdict(options.task)))
    for attribute, title, _, specs in training_concerns():
        values = options if attribute is None else getattr(options, attribute)
        text += f"# {title}\n" + lines({spec.name: getattr(values, spec.name) for spec in specs
                                        if spec.name != "resume_changed_state"})  # for one resume, not a run
    return text


def training_options(options: TrainOptions) -> dict[str, Any]:
    """The training options alone (not the task's), every concern's, by field name."""
    return {spec.name: getattr(options if attribute is None else getattr(options, attribute), spec.name)
            for attribute, _, _, specs in training_concerns() for spec in specs}


def every_option(options: TrainOptions) -> dict[str, Any]:
    """The training and the task options as one flat dict, by field name (what checkpoints record)."""
    return {**training_options(options), **dataclasses.asdict(options.task)}


def recorded(options: TrainOptions) -> RecordedOptions:
    """The options as checkpoints keep them: every one by name, the task options marked fixed=True (a checkpoint
    cannot be resumed once they change), and the --config file that runs this run again."""
    return RecordedOptions(every_option(options), frozenset(
        spec.name for spec in dataclasses.fields(options.task) if spec.metadata.get("fixed")),
        lambda: config_text(options))
