"""Experiment trackers (--tracker wandb or mlflow): rank 0 sends each metrics row there too.

One job is one tracker run. Its id is kept in <ckpt-dir>/tracker.json, so every restart of the job continues
the same run: torchrun's after a kill -9, a resume after SIGTERM, a Slurm requeue, another world size. Steps a
restarted job trains again are not sent again: tracker.json also holds the last step sent for each kind of
row, written before the row is sent, so a kill can lose a row but never send one twice.

A tracker that cannot be reached (no network, a bad key) or fails later costs one warning, and training goes
on without it. Neither library is a dependency of the project: pip install -e '.[wandb]' or '.[mlflow]'.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from .distributed import DistEnv
from .options import TrainOptions, every_option

log = logging.getLogger("train")


class RunRecord:
    """<ckpt-dir>/tracker.json: which tracker run this job logs to, and the last step sent per kind of row."""

    def __init__(self, ckpt_dir: str, tracker: str):
        self.path = Path(ckpt_dir) / "tracker.json"
        saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        # Another --tracker than the one recorded starts a run in that tracker (and records it instead).
        self.state = saved if saved.get("tracker") == tracker else {"tracker": tracker, "run_id": None, "sent": {}}

    @property
    def run_id(self) -> str | None:
        return self.state["run_id"]

    def claim(self, kind: str, step: int) -> bool:
        """Whether a `kind` row for `step` is new to the run; if so, it is recorded as sent."""
        if step <= self.state["sent"].get(kind, 0):
            return False
        self.state["sent"][kind] = step
        self.save()
        return True

    def save(self, run_id: str | None = None) -> None:
        if run_id is not None:
            self.state["run_id"] = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".tracker.json.")
        with os.fdopen(handle, "w") as file:
            json.dump(self.state, file)
        os.replace(temporary, self.path)  # atomic: a kill leaves the old record or the new one


class WandbRun:
    """A Weights & Biases run (project: WANDB_PROJECT, else the project's name). WANDB_MODE=offline keeps it on
    this disk, for `wandb sync` to upload later."""

    def __init__(self, record: RunRecord, config: dict[str, Any], resume: tuple[int, str] | None):
        import wandb

        run_id = record.run_id or uuid.uuid4().hex[:12]
        self.run = wandb.init(id=run_id, resume="allow", project=os.environ.get("WANDB_PROJECT", PROJECT),
                              config=config, settings=wandb.Settings(console="off", init_timeout=30))
        record.save(run_id)
        if resume:
            self.run.config.update(config, allow_val_change=True)  # the world size may have changed
            number, what = resume
            self.run.tags = (*self.run.tags, f"resume {number}")
            self.run.config.update({f"resume {number}": what}, allow_val_change=True)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{kind}/{name}": value for name, value in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowRun:
    """An MLflow run, in the server or store MLFLOW_TRACKING_URI names (experiment: MLFLOW_EXPERIMENT_NAME, else
    the project's name). Metrics go in the background (synchronous=False): a slow server never holds up a step."""

    def __init__(self, record: RunRecord, config: dict[str, Any], resume: tuple[int, str] | None):
        import mlflow

        self.mlflow = mlflow
        if "MLFLOW_EXPERIMENT_NAME" not in os.environ and "MLFLOW_EXPERIMENT_ID" not in os.environ:
            mlflow.set_experiment(PROJECT)
        run = mlflow.start_run(run_id=record.run_id, log_system_metrics=False)
        if record.run_id is None:  # parameters cannot change in MLflow: the options once, changes as tags
            mlflow.log_params({name: str(value)[:6000] for name, value in config.items()})
        record.save(run.info.run_id)
        mlflow.set_tags({"world_size": config["world_size"], "nodes": config["nodes"]})
        if resume:
            number, what = resume
            mlflow.set_tag(f"resume {number}", what)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({f"{kind}/{name}": value for name, value in values.items()}, step=step,
                                synchronous=False)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"wandb": WandbRun, "mlflow": MlflowRun}
PROJECT = "{{ cookiecutter.project_slug }}"  # the W&B project and MLflow experiment, unless the environment names one


class Tracker:
    """Rank 0's tracker run, or nothing: every failure is one warning, after which rows are not sent."""

    def __init__(self, options: TrainOptions, env: DistEnv, resumed_step: int, changes: list[str]):
        self.run, self.record = None, None
        if options.tracker not in TRACKERS or not env.is_main_process:
            return
        config = {**every_option(options), "world_size": env.world_size, "nodes": env.num_nodes}
        try:
            self.record = RunRecord(options.ckpt_dir, options.tracker)
            resume = None
            if self.record.run_id:  # a restart of this job: say where it resumed, on how many ranks, with what
                number = self.record.state["resumes"] = self.record.state.get("resumes", 0) + 1
                resume = (number, f"at step {resumed_step} on {env.world_size} ranks (restart {env.restart_count})"
                          + (f"; {'; '.join(changes)}" if changes else "; no option changed"))
            self.run = TRACKERS[options.tracker](self.record, config, resume)
        except Exception as error:  # noqa: BLE001 - a tracker must never stop training
            self.warn(f"could not start the {options.tracker} run", error)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        if self.run is None or not self.record.claim(kind, step):
            return
        try:
            self.run.log(kind, step, values)
        except Exception as error:  # noqa: BLE001
            self.warn(f"could not log step {step}", error)

    def close(self) -> None:
        if self.run is not None:
            try:
                self.run.close()
            except Exception as error:  # noqa: BLE001
                self.warn("could not close the run", error)

    def warn(self, what: str, error: Exception) -> None:
        log.warning("--tracker: %s (%s: %s); training goes on without it", what, type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "")
        self.run = None
