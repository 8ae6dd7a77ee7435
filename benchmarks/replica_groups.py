"""Replica groups (a fault_tolerance=torchft bake) measured on the project's own train.py and run_node.sh: the
cost per step against the default mode, and what a kill -9 of one group's rank costs the other.

    python benchmarks/replica_groups.py --trials 5

Two groups of one CPU rank each (run_node.sh with REPLICA_GROUPS=2, group 0 starting the Lighthouse), the
image task's small CNN on fake 16-px images, 16 per rank per step, no loader workers:
- overhead: the median seconds per step of steps 11-100, torchft against the default mode's one torchrun of two
  ranks (the same global batch), each run `--trials` times;
- a kill: group 1's rank kills itself with SIGKILL at step 20, either inside backward (a gradient hook on the
  first layer, whose gradient comes last: the survivor waits for a bucket that never comes) or between steps
  (in Task.after_step of step 19, after its commit), or inside the write of its step-20 checkpoint (torch.save
  replaced by one that writes half a file and dies). Per trial: the survivor's stall (its longest gap between
  two logged steps after the kill, less its median gap), the steps it dropped (its step count less torchft's
  committed ones), the seconds from the kill to the restarted group's heal, the step it healed at, and whether
  both groups' final checkpoints hold the same model and optimizer bit for bit.
The survivor slows to 0.2 s a step while alone, so that the run is still going when the group comes back.
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from common import bake_default_project, child_env, scratch_dir, spread

STEPS = 100
ARGS = ["--model", "small_cnn", "--data", "fake", "--fake-samples", "2048", "--image-size", "16", "--batch-size", "16",
        "--device", "cpu", "--num-workers", "0", "--log-every", "1", "--ckpt-every", "20", "--max-steps", str(STEPS)]

KILL = '''

import dataclasses as _dataclasses
import os as _os
import signal as _signal
import time as _time

_compute_loss, _after_step = TASK.compute_loss, TASK.after_step


def _die():
    open(_os.environ["KILLED_AT"], "w").write(repr(_time.time()))
    _os.kill(_os.getpid(), _signal.SIGKILL)


def _first_attempt_of_group(group):
    return _os.environ.get("REPLICA_GROUP_ID") == group and _os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"


def _compute_loss_that_may_die(model, batch, step):
    loss = _compute_loss(model, batch, step)
    if _os.environ.get("KILL") == "backward" and _first_attempt_of_group("1") and step.number == 20:
        next(model.parameters()).register_hook(lambda grad: _die())
    if _os.environ.get("REPLICA_GROUP_ID") == "1" and _os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
        open(_os.environ["KILLED_AT"] + ".back", "a").close()
    if (_os.environ.get("REPLICA_GROUP_ID") == "0" and _os.path.exists(_os.environ["KILLED_AT"])
            and not _os.path.exists(_os.environ["KILLED_AT"] + ".back")):
        _time.sleep(0.2)
    return loss


def _after_step_that_may_die(step):
    _after_step(step)
    if _os.environ.get("KILL") == "between" and _first_attempt_of_group("1") and step.number == 19:
        _die()


_torch_save = torch.save


def _save_that_may_die(state, file, *args, **kwargs):  # a checkpoint's write, cut short half-way
    if _os.environ.get("KILL") == "save" and _first_attempt_of_group("1") and state.get("step") == 20:
        file.write(b"PK half a checkpoint")
        file.flush()
        _die()
    return _torch_save(state, file, *args, **kwargs)


torch.save = _save_that_may_die
TASK = _dataclasses.replace(TASK, compute_loss=_compute_loss_that_may_die, after_step=_after_step_that_may_die)
'''


def seconds_of_day(clock: str) -> float:
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def step_times(log: str) -> dict[int, float]:
    """When each step was logged (seconds of the day), from train.py's `HH:MM:SS.mmm step N | ...` lines."""
    return {int(step): seconds_of_day(clock) for clock, step in re.findall(r"(\d\d:\d\d:\d\d\.\d{3}) step (\d+) \|",
                                                                          log)}


def seconds_per_step(log: str) -> float:
    times = step_times(log)
    return statistics.median(times[step] - times[step - 1] for step in range(12, STEPS + 1))


def run_default(project: Path, folder: Path) -> float:
    result = subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", "train.py", *ARGS, "--ckpt-dir",
                             str(folder / "ckpt")], cwd=project, env=child_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return seconds_per_step(result.stderr)


def run_groups(project: Path, folder: Path, kill: str | None, port: int) -> list[str]:
    folder.mkdir(parents=True)
    logs = [folder / f"group-{group}.log" for group in (0, 1)]
    environment = {**child_env(), "REPLICA_GROUPS": "2", "RDZV_ENDPOINT": f"localhost:{port}", "NPROC_PER_NODE": "1",
                   "MAX_RESTARTS": "1", "KILL": kill or "", "KILLED_AT": str(folder / "killed-at")}
    groups = [subprocess.Popen(["./run_node.sh", *ARGS, "--ckpt-dir", str(folder / "ckpt")], cwd=project,
                               env={**environment, "REPLICA_GROUP_ID": str(group)}, stdout=log.open("w"),
                               stderr=subprocess.STDOUT) for group, log in enumerate(logs)]
    for group in groups:
        group.wait(timeout=600)
    outputs = [log.read_text() for log in logs]
    assert [group.returncode for group in groups] == [0, 0], "\n----\n".join(output[-3000:] for output in outputs)
    return outputs


def kill_trial(project: Path, folder: Path, kill: str, port: int) -> dict:
    survivor, restarted = run_groups(project, folder, kill, port)
    killed_at = datetime.datetime.fromtimestamp(float((folder / "killed-at").read_text()))
    killed = killed_at.hour * 3600 + killed_at.minute * 60 + killed_at.second + killed_at.microsecond / 1e6
    times = step_times(survivor)
    steps = sorted(times)
    gaps = [times[step] - times[previous] for previous, step in zip(steps, steps[1:], strict=False)]
    after = [times[step] - times[previous] for previous, step in zip(steps, steps[1:], strict=False)
             if times[step] > killed][:5]  # the first steps after the kill, before the slow steps alone
    heal = re.findall(r"(\d\d:\d\d:\d\d\.\d{3}) healed from another replica group: step (\d+)",
                      restarted[restarted.index("restart=1"):])
    finals = [torch.load(folder / "ckpt" / f"replica-group-{group}" / f"step-{STEPS}.pt", weights_only=True)
              for group in (0, 1)]
    same = all(torch.equal(finals[0]["model"][name], tensor) for name, tensor in finals[1]["model"].items()) and all(
        torch.equal(finals[0]["optimizer"]["state"][index][name], tensor)
        for index, state in finals[1]["optimizer"]["state"].items() for name, tensor in state.items())
    return {"stall": max(after) - statistics.median(gaps), "dropped": STEPS - finals[0]["replica_groups"]["step"],
            "heal_after": seconds_of_day(heal[0][0]) - killed if heal else None,
            "healed_at": int(heal[0][1]) if heal else None, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--port", type=int, default=29620, help="the Lighthouse's, on localhost")
    arguments = parser.parse_args()
    project = bake_default_project(fault_tolerance="torchft")
    with (project / "ddp_training" / "task.py").open("a") as task:
        task.write(KILL)
    scratch = scratch_dir()
    default, groups = [], []
    for trial in range(arguments.trials):
        default.append(run_default(project, scratch / f"default-{trial}"))
        groups.append(seconds_per_step(run_groups(project, scratch / f"groups-{trial}", None, arguments.port)[0]))
        print(f"trial {trial + 1}: {default[-1] * 1e3:.1f} ms a step by default, {groups[-1] * 1e3:.1f} ms in "
              "replica groups", flush=True)
    print(f"seconds per step, median (min-max) of {arguments.trials}: default {spread(default, '.4f')}, replica "
          f"groups {spread(groups, '.4f')}")
    for kill in ("backward", "between", "save"):
        results = []
        for trial in range(arguments.trials):
            results.append(kill_trial(project, scratch / f"{kill}-{trial}", kill, arguments.port))
            print(f"kill {kill}, trial {trial + 1}: {results[-1]}", flush=True)
            time.sleep(1)
        print(f"kill {kill}: stall {spread([r['stall'] for r in results])} s, heal after "
              f"{spread([r['heal_after'] for r in results if r['heal_after'] is not None])} s, dropped "
              f"{sorted(r['dropped'] for r in results)}, healed at {sorted(r['healed_at'] for r in results)}, "
              f"same model {sum(r['same'] for r in results)}/{len(results)}")


if __name__ == "__main__":
    main()
