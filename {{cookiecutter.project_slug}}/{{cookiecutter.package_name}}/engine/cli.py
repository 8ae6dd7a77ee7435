"""The command line and --config files, made from TrainOptions' fields and the task's TaskOptions: one flag per
field, its help the field's, grouped by concern in --help; a YAML (or TOML) file of the same names, checked as
its flags would be; and the resolved options written back as such a file, and recorded in checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .checkpoint import RecordedOptions
from .errors import UsageError
from .flags import flag


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing its usage and exiting, so a bad flag is reported
    once per job like any other usage error, not by every rank of every attempt."""

    def error(self, message: str):
        raise UsageError(f"{message}; see python train.py --help")


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to each flag's help, except where the help already says what its default means
    ("(default: no limit)" was followed by "(default: None)") and where the default is None: such a
    flag is off unless given, which "(default: None)" does not say any better."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or (action.help and "(default:" in action.help):
            return action.help
        return super()._get_help_string(action)


def build_parser(options_class: type, task_options: type, training_defaults: dict[str, Any]) -> argparse.ArgumentParser:
    """One command line for the task's options (first in --help) and the training options; training_defaults
    (Task.training_defaults) replace the defaults of training options that suit the task differently."""
    parser = ArgumentParser(
        description="Train a model (task.py); launch with torchrun or run_node.sh (see train.py).",
        formatter_class=DefaultsOnceFormatter,
    )
    concerns = training_concerns(options_class)
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


def training_concerns(options_class: type) -> list[tuple[str | None, str, type, list[dataclasses.Field]]]:
    """The training options (TrainOptions) by concern: (the attribute, None for the loop's own; the --help
    title; the dataclass; its option fields)."""
    own = [spec for spec in dataclasses.fields(options_class) if spec.metadata.get("help")]
    return [(None, "training", options_class, own)] + [
        (spec.name, spec.metadata["group"], spec.default_factory, list(dataclasses.fields(spec.default_factory)))
        for spec in dataclasses.fields(options_class) if "group" in spec.metadata]


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


def parse_options(argv: list[str] | None, options_class: type, task_options: type,
                  training_defaults: dict[str, Any] | None = None) -> Any:
    """Parse argv into checked options_class (TrainOptions), with the task's options (a TaskOptions) in .task; raises
    UsageError on values that cannot work. With --config FILE, the file's values replace the defaults and the
    command line wins over both; with --print-config, print the resolved options as such a file and exit."""
    parser = build_parser(options_class, task_options, training_defaults or {})
    argv = accept_underscores(sys.argv[1:] if argv is None else argv)
    config_file = parser.parse_known_args(argv)[0].config  # a bad flag is parse_args' to report, below
    if config_file:
        kinds = [task_options] + [kind for _, _, kind, _ in training_concerns(options_class)]
        optional = {name for kind in kinds for name, hint in typing.get_type_hints(kind).items()
                    if type(None) in typing.get_args(hint)}
        parser.set_defaults(**read_config(config_file, parser, optional))
    namespace = vars(parser.parse_args(argv))
    del namespace["config"]
    print_config = namespace.pop("print_config")
    if namespace.pop("deprecated_local_rank") is not None:
        logging.getLogger(__name__).warning(
            "--local-rank is ignored: torchrun sets LOCAL_RANK in the environment, which wins")
    options = options_from(namespace, options_class, task_options)
    options.check()
    if print_config:
        if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
            print(config_text(options), end="")
        raise SystemExit(0)
    return options


def options_from(values: dict[str, Any], options_class: type, task_options: type) -> Any:
    """options_class (TrainOptions) with its concerns and the task's options in .task, from values by field name."""
    def fields(specs) -> dict[str, Any]:
        return {spec.name: values[spec.name] for spec in specs}
    (_, _, _, own), *groups = training_concerns(options_class)
    return options_class(**fields(own), **{attribute: kind(**fields(specs)) for attribute, _, kind, specs in groups},
                         task=task_options(**fields(dataclasses.fields(task_options))))


def recorded_options(record: dict[str, Any], options_class: type, task_options: type,
                     training_defaults: dict[str, Any] | None = None) -> Any:
    """The options a checkpoint recorded (every_option's dict, by name) as options_class, as the run had them: a
    name this code no longer has is left out, one added since takes its default."""
    parser = build_parser(options_class, task_options, training_defaults or {})
    namespace = vars(parser.parse_args([]))
    return options_from({**namespace, **{name: value for name, value in record.items() if name in namespace}},
                        options_class, task_options)


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


def config_text(options: Any) -> str:
    """The resolved options as a --config file (YAML): `python train.py --config FILE` runs the same run."""
    import yaml

    def lines(values: dict[str, Any]) -> str:
        return "".join(yaml.safe_dump({name: value}, sort_keys=False) for name, value in values.items())
    text = ("# python train.py --config THIS_FILE runs with these options; a flag given as well wins over the file\n"
            "# what is trained (task.py)\n" + lines(dataclasses.asdict(options.task)))
    for attribute, title, _, specs in training_concerns(type(options)):
        values = options if attribute is None else getattr(options, attribute)
        text += f"# {title}\n" + lines({spec.name: getattr(values, spec.name) for spec in specs
                                        if spec.name != "resume_changed_state"})  # for one resume, not a run
    return text


def training_options(options: Any) -> dict[str, Any]:
    """The training options alone (not the task's), every concern's, by field name."""
    return {spec.name: getattr(options if attribute is None else getattr(options, attribute), spec.name)
            for attribute, _, _, specs in training_concerns(type(options)) for spec in specs}


def every_option(options: Any) -> dict[str, Any]:
    """The training and the task options as one flat dict, by field name (what checkpoints record)."""
    return {**training_options(options), **dataclasses.asdict(options.task)}


def recorded(options: Any) -> RecordedOptions:
    """The options as checkpoints keep them: every one by name, the task options marked fixed=True (a checkpoint
    cannot be resumed once they change), and the --config file that runs this run again."""
    return RecordedOptions(every_option(options), frozenset(
        spec.name for spec in dataclasses.fields(options.task) if spec.metadata.get("fixed")),
        lambda: config_text(options))
