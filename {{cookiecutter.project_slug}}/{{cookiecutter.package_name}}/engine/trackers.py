"""Experiment trackers (--tracker wandb or mlflow): rank 0 sends each metrics row there too.

One job is one tracker run. Its id is kept in <ckpt-dir>/tracker.json, and a job that resumes from a
checkpoint continues that run: torchrun's restart after a kill -9, a resume after SIGTERM, a Slurm requeue,
another world size. A job that starts from scratch starts a new run. Steps a restarted job trains again are
not sent again: tracker.json also holds the last step sent, written before each row is sent, so a kill can
lose rows but never send one twice.

Training never waits on a tracker: rows go on a queue that a background thread sends; a tracker that cannot
be reached (no network, a bad key) or fails later costs one warning, and the rows are dropped. The library is
imported on the main thread (not while DataLoader workers are forked) and is not a dependency of the project:
pip install -e '.[wandb]' or '.[mlflow]'.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import queue
import socket
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint.folder import TRACKER_RECORD, write_json
from .cli import every_option
from .distributed import DistEnv

if TYPE_CHECKING:  # for annotations only: the engine imports nothing around it
    from ..options import TrainOptions

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30  # at the end of a run, for the queue's last rows and the tracker's own flush
# The W&B project and the MLflow experiment, unless the environment names one.
PROJECT = "{{ cookiecutter.project_slug }}"


class RunRecord:
    """<ckpt-dir>/tracker.json: the tracker run this job logs to, and the last step sent (with the kinds of
    row already sent at that step: a training row and an evaluation row share a step)."""

    def __init__(self, ckpt_dir: str, tracker: str, resumed_step: int):
        self.path = Path(ckpt_dir) / TRACKER_RECORD
        saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        # Only a job that resumes from a checkpoint continues the recorded run, and only in the same tracker.
        continues = saved.get("tracker") == tracker and resumed_step > 0
        self.state = saved if continues else {"tracker": tracker, "run_id": None, "sent": [0, []], "resumes": 0}

    @property
    def run_id(self) -> str | None:
        return self.state["run_id"]

    def claim(self, kind: str, step: int) -> bool:
        """Whether a `kind` row for `step` is new to the run; if so, it is recorded as sent. W&B needs steps
        that never decrease, so one mark serves every kind of row."""
        last, kinds = self.state["sent"]
        if step < last or (step == last and kind in kinds):
            return False
        self.state["sent"] = [step, [*kinds, kind] if step == last else [kind]]
        self.save()
        return True

    def save(self, run_id: str | None = None) -> None:
        """Written whole: a kill leaves the old record or the new one."""
        if run_id is not None:
            self.state["run_id"] = run_id
        write_json(self.path, self.state)


class WandbRun:
    """A Weights & Biases run (project: WANDB_PROJECT, else the project's name). Online, each attempt appends to
    the run; with WANDB_MODE=offline each attempt writes its own folder under the same run id."""

    def __init__(self, wandb, record: RunRecord, config: dict[str, Any], resume: tuple[int, str] | None):
        run_id = record.run_id or uuid.uuid4().hex[:12]
        record.save(run_id)  # first: a kill during init must not leave a run this job forgets
        settings = wandb.Settings(console="off", init_timeout=30, login_timeout=10, finish_timeout=CLOSE_TIMEOUT_S)
        self.run = wandb.init(id=run_id, resume="allow", project=os.environ.get("WANDB_PROJECT", PROJECT),
                              config=config, settings=settings)
        if resume:
            number, what = resume
            self.run.config.update({**config, f"resume {number}": what}, allow_val_change=True)  # a new world size
            self.run.tags = (*self.run.tags, f"resume {number}")

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{kind}/{name}": value for name, value in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowRun:
    """An MLflow run, in the server or store MLFLOW_TRACKING_URI names (experiment: MLFLOW_EXPERIMENT_NAME, else
    the project's name). Parameters cannot change in MLflow: the options are logged once, as the first attempt
    had them; the current world size and each resume are tags."""

    def __init__(self, mlflow, record: RunRecord, config: dict[str, Any], resume: tuple[int, str] | None):
        self.mlflow = mlflow
        make_a_new_sqlite_store_whole(mlflow)
        if "MLFLOW_EXPERIMENT_NAME" not in os.environ and "MLFLOW_EXPERIMENT_ID" not in os.environ:
            mlflow.set_experiment(PROJECT)
        run = mlflow.start_run(run_id=record.run_id, log_system_metrics=False)
        if record.run_id is None:
            mlflow.log_params({name: str(value)[:6000] for name, value in config.items()})
        record.save(run.info.run_id)
        mlflow.set_tags({"world_size": config["world_size"], "nodes": config["nodes"]})
        if resume:
            number, what = resume
            mlflow.set_tag(f"resume {number}", what)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({f"{kind}/{name}": value for name, value in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def make_a_new_sqlite_store_whole(mlflow) -> None:
    """A new sqlite store (MLFLOW_TRACKING_URI=sqlite:///PATH, MLflow 3's default sqlite:///mlflow.db) is made by
    its first client, which runs MLflow's schema migrations for seconds: a rank killed meanwhile left a
    half-migrated database that no client could open again, `mlflow ui` included ("table _alembic_tmp_... already
    exists"). So it is made under a temporary name beside PATH and linked into place whole (never over another
    one); a kill leaves only the temporary file, which the next start on this machine removes."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    if path.exists():
        return
    host = socket.gethostname()
    prefix = f".{path.name}.partial-{host}-"
    for stale in path.parent.glob(f"{prefix}*"):  # of a process here that was killed; sqlite's -journal too
        maker = stale.name.removeprefix(prefix).split("-", 1)[0]
        if maker.isdigit() and (int(maker) == os.getpid() or not process_exists(int(maker))):  # a pid reused
            stale.unlink(missing_ok=True)  # by this process (a container's restart) names a killed one's too
    partial = path.with_name(f"{prefix}{os.getpid()}")
    try:
        mlflow.MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments()  # creates and migrates it
        with contextlib.suppress(FileExistsError):  # another job made it meanwhile: theirs is whole too
            os.link(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether there is such a process
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


TRACKERS = {"wandb": WandbRun, "mlflow": MlflowRun}


class Tracker:
    """Rank 0's tracker run (metrics.py's MetricsLog, which holds it, exists on rank 0 only), fed by a
    background thread; with --tracker tensorboard or none, nothing. Every failure is one warning, after which
    rows are dropped."""

    def __init__(self, options: TrainOptions, env: DistEnv, resumed_step: int, changes: list[str]):
        self.rows: queue.Queue = queue.Queue(maxsize=10_000)  # full (a tracker far behind): rows are dropped
        self.thread, self.failed = None, False
        if options.logging.tracker not in TRACKERS:
            return
        if options.logging.tracker == "mlflow":  # a server that is down: a few seconds per request, not minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            library = importlib.import_module(options.logging.tracker)
        except ImportError as error:
            name = options.logging.tracker
            self.warn(f"{name} is not installed (pip install -e '.[{name}]')", error)
            return
        config = {**every_option(options), "world_size": env.world_size, "nodes": env.num_nodes}
        ranks = f"{env.world_size} rank{'s' if env.world_size > 1 else ''}"
        resumed = f"at step {resumed_step} on {ranks} (restart {env.restart_count})" + (
            f"; {'; '.join(changes)}" if changes else "; no option changed")
        self.thread = threading.Thread(target=self.send, name="tracker", daemon=True,
                                       args=(TRACKERS[options.logging.tracker], library, options, resumed_step, config,
                                             resumed))
        self.thread.start()

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        if self.thread is not None and not self.failed:
            try:
                self.rows.put_nowait((kind, step, values))
            except queue.Full:
                pass

    def send(self, kind: type, library, options: TrainOptions, resumed_step: int, config: dict, resumed: str):
        """The background thread: start (or continue) the run, send each row, close it."""
        try:
            record = RunRecord(options.checkpoint.ckpt_dir, options.logging.tracker, resumed_step)
            resume = None
            if record.run_id:
                record.state["resumes"] += 1
                resume = (record.state["resumes"], resumed)
            run = kind(library, record, config, resume)
            while (row := self.rows.get()) is not None:
                if record.claim(row[0], row[1]):
                    run.log(*row)
            run.close()
        except Exception as error:  # noqa: BLE001 - a tracker must never stop training
            self.warn(f"the {options.logging.tracker} run failed", error)

    def close(self) -> None:
        """Send the rows still queued and close the run, waiting at most CLOSE_TIMEOUT_S."""
        if self.thread is None:
            return
        try:
            self.rows.put(None, timeout=1)
        except queue.Full:
            pass
        self.thread.join(CLOSE_TIMEOUT_S)
        if self.thread.is_alive():
            self.warn(f"the run did not finish within {CLOSE_TIMEOUT_S} s",
                      TimeoutError("its last rows may be missing"))

    def warn(self, what: str, error: Exception) -> None:
        if not self.failed:
            self.failed = True
            log.warning("--tracker: %s (%s: %s); training goes on without it", what, type(error).__name__,
                        str(error).strip().splitlines()[0] if str(error).strip() else "")
