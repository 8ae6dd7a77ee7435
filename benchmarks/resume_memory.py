"""Host memory of a DDP resume, per rank: what loading the newest checkpoint costs on top of training.

    python benchmarks/resume_memory.py --trials 3                       # this checkout
    python benchmarks/resume_memory.py --trials 3 --template /tmp/old   # another checkout of the template

Bakes the default project, trains --model resnet152 (60 M parameters; SGD with momentum: a 480 MB checkpoint)
for one step on 2 CPU ranks and saves, then, --trials times: a fresh 1-step run and a resume of the saved
step for one more, each rank sampling its own memory every 5 ms (a sitecustomize on PYTHONPATH). Prints, for
each, every rank's peak anonymous memory (RssAnon: the process's own, not file pages the machine's ranks
share in the page cache) and peak resident set (VmHWM, file pages included), median and range over trials.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import TEMPLATE_ROOT, child_env, scratch_dir, spread
from cookiecutter.main import cookiecutter

SAMPLER = '''
import atexit, json, os, threading, time
if "RANK" in os.environ and os.environ.get("MEMORY_LOG_DIR"):
    peak = {"RssAnon": 0}
    def fields():
        with open("/proc/self/status") as status:
            return {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("Rss", "VmHWM"))}
    def sample():
        while True:
            peak["RssAnon"] = max(peak["RssAnon"], fields()["RssAnon"])
            time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    def write():
        out = os.path.join(os.environ["MEMORY_LOG_DIR"], f"rank-{os.environ['RANK']}.json")
        with open(out, "w") as file:
            json.dump({"anon_mib": peak["RssAnon"] / 1024, "hwm_mib": fields()["VmHWM"] / 1024}, file)
    atexit.register(write)
'''


def train(project: Path, ckpt_dir: Path, steps: int, memory_dir: Path | None, sampler_dir: Path) -> list[dict]:
    env = child_env()
    if memory_dir is not None:
        memory_dir.mkdir(parents=True)
        env |= {"MEMORY_LOG_DIR": str(memory_dir), "PYTHONPATH": str(sampler_dir)}
    command = ["torchrun", "--standalone", "--nproc-per-node=2", "train.py", "--model", "resnet152", "--data",
               "fake", "--fake-samples", "64", "--image-size", "16", "--batch-size", "2", "--num-workers", "0",
               "--device", "cpu", "--max-steps", str(steps), "--ckpt-every", "1", "--keep-checkpoints", "1",
               "--eval-every", "0", "--ckpt-dir", str(ckpt_dir)]
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    if memory_dir is None:
        return []
    return [json.loads((memory_dir / f"rank-{rank}.json").read_text()) for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--template", default=str(TEMPLATE_ROOT), help="the template checkout to bake")
    args = parser.parse_args()
    scratch = scratch_dir("resume-memory-")
    project = Path(cookiecutter(args.template, no_input=True, output_dir=str(scratch / "bake")))
    (scratch / "sitecustomize.py").write_text(SAMPLER)
    saved = scratch / "saved"
    train(project, saved, 1, None, scratch)
    checkpoint = next(saved.glob("step-1.pt"))
    print(f"template {args.template}; checkpoint {checkpoint.stat().st_size / 2**20:,.0f} MiB; 2 CPU ranks")
    runs: dict[str, list[list[dict]]] = {"fresh 1 step": [], "resume + 1 step": []}
    for trial in range(args.trials):
        runs["fresh 1 step"].append(train(project, scratch / f"fresh-{trial}", 1, scratch / f"m-fresh-{trial}",
                                          scratch))
        resumed = scratch / f"resumed-{trial}"
        resumed.mkdir()
        (resumed / checkpoint.name).hardlink_to(checkpoint)  # retention deletes the link, not the saved file
        runs["resume + 1 step"].append(train(project, resumed, 2, scratch / f"m-resumed-{trial}", scratch))
    print("| run | rank | peak anonymous MiB | peak resident MiB |\n| --- | --- | --- | --- |")
    for name, trials in runs.items():
        for rank in range(2):
            print(f"| {name} | {rank} | {spread([t[rank]['anon_mib'] for t in trials], ',.0f')} | "
                  f"{spread([t[rank]['hwm_mib'] for t in trials], ',.0f')} |")
    print(f"median (min-max) over {args.trials} trials")


if __name__ == "__main__":
    main()
