"""The first GPU run of the generated project (issue 11): one command, one markdown table.

    python benchmarks/gpu_check.py --out gpu_check.md            # one GPU, estimated 7-9 minutes on an H200
    python benchmarks/gpu_check.py --dry-run --out /tmp/dry.md   # CPU, gloo, tiny sizes (the test suite runs it)

Needs only torch, torchvision and cookiecutter. It bakes the template with its defaults, the preflight
added, into a temporary folder and runs, one rank each under torchrun (NCCL on a GPU):

- the preflight (rank map, device, all-reduce);
- pure compute and the bare DDP loop of bare_ddp_loop.py, at the settings of the bf16 channels-last row;
- train.py in fp32, in bf16, in bf16 channels-last, and that with --compile; FSDP2 in bf16 with and
  without channels-last: steady-state img/s (median of 5-step windows after warm-up), peak memory, data wait;
- host syncs per training step (torch.cuda.set_sync_debug_mode, the difference between two run lengths);
- a dropout model (mobilenet_v3_small) stopped and resumed against an uninterrupted run: bitwise equal?

A row that failed says so in its status and notes; the command still prints the whole table.
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from common import bake_default_project, child_env

BENCHMARKS = Path(__file__).resolve().parent
SYNC_COUNT_FLAG = "--count-host-syncs-into"  # internal: run train.py in this process, counting host syncs


@dataclass
class Settings:
    device: str
    model: str
    image_size: int
    batch_size: int
    steps: int
    num_workers: int
    timeout: int  # seconds per run

    @classmethod
    def for_run(cls, dry_run: bool) -> Settings:
        if dry_run:
            return cls("cpu", "resnet18", 64, 4, 6, 0, 120)  # 64 px: see test_fsdp.py on CPU bf16 at 1x1
        return cls("cuda", "resnet50", 224, 128, 60, 8, 240)


@dataclass
class Row:
    case: str
    status: str  # ok, FAIL, or n/a
    images_per_second: float | None = None
    versus: str = ""
    peak_gib: float | None = None
    notes: str = ""

    def markdown(self) -> str:
        rate = f"{self.images_per_second:.1f}" if self.images_per_second else ""
        peak = f"{self.peak_gib:.2f}" if self.peak_gib is not None else ""
        return f"| {self.case} | {self.status} | {rate} | {self.versus} | {peak} | {self.notes} |"


class Check:
    def __init__(self, project: Path, settings: Settings, dry_run: bool):
        self.project, self.settings, self.dry_run = project, settings, dry_run
        self.scratch = project / "gpu-check"
        self.sync_count = self.scratch / "channels-last.count"  # a dry run's count of host syncs
        self.env = child_env()
        if not dry_run:
            self.env.pop("OMP_NUM_THREADS")

    def command(self, command: list[str]) -> tuple[bool, str]:
        try:
            result = subprocess.run(command, cwd=self.project, env=self.env, capture_output=True, text=True,
                                    timeout=self.settings.timeout)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {self.settings.timeout} s"
        output = result.stdout + result.stderr
        print(output[-1500:] if result.returncode else f"ok: {' '.join(command[:6])} ...", flush=True)
        return result.returncode == 0, output

    def torchrun(self, *args: str) -> list[str]:
        return ["torchrun", "--standalone", "--nproc-per-node=1", *args]

    def train_args(self, name: str, *extra: str, steps: int | None = None) -> list[str]:
        s = self.settings
        steps = steps or s.steps
        return ["--data", "fake", "--model", s.model, "--image-size", str(s.image_size), "--batch-size",
                str(s.batch_size), "--fake-samples", str(s.batch_size * (steps + 1)), "--num-workers",
                str(s.num_workers), "--device", s.device, "--max-steps", str(steps), "--eval-every", "0",
                "--log-every", "5", "--ckpt-every", "100000", "--ckpt-dir", str(self.scratch / name / "checkpoints"),
                "--log-dir", str(self.scratch / name / "logs"), *extra]

    def train(self, case: str, *extra: str, count_syncs_into: Path | None = None) -> Row:
        """A train.py run's row; with count_syncs_into, run through count_host_syncs, which writes its count."""
        name = re.sub(r"\W+", "-", case)
        script = (str(Path(__file__).resolve()), SYNC_COUNT_FLAG, str(count_syncs_into)) if count_syncs_into else ()
        ok, output = self.command(self.torchrun(*(script or ("train.py",)), *self.train_args(name, *extra)))
        if not ok:
            return Row(case, "FAIL", notes=last_error(output))
        rows = [json.loads(line) for line in (self.scratch / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        rows = [row for row in rows if row["kind"] == "train"]
        steady = rows[len(rows) // 4:]  # after warm-up (cuDNN autotuning, compilation)
        wait = statistics.median(row["data_wait_frac"] for row in steady)
        peak = max((row.get("max_memory_gib", 0) for row in rows), default=0) or None
        return Row(case, "ok", statistics.median(row["samples_per_sec"] for row in steady), peak_gib=peak,
                   notes=f"data wait {100 * wait:.0f}%")

    def baseline(self, case: str, mode: str) -> Row:
        s = self.settings
        args = [str(BENCHMARKS / "bare_ddp_loop.py"), mode, "--model", s.model, "--image-size", str(s.image_size),
                "--batch-size", str(s.batch_size), "--steps", str(s.steps), "--device", s.device,
                "--precision", "bf16", "--channels-last"]
        if mode == "bare":
            command = self.torchrun(*args, "--fake-samples", str(s.batch_size * (s.steps + 1)),
                                    "--num-workers", str(s.num_workers), "--snapshot", str(self.scratch / "bare.pt"))
            self.env["PYTHONPATH"] = str(self.project)  # the bare loop uses the project's dataset class
        else:
            command = [sys.executable, *args]
        ok, output = self.command(command)
        self.env.pop("PYTHONPATH", None)
        if not ok:
            return Row(case, "FAIL", notes=last_error(output))
        peak = re.search(r"peak memory GiB ([\d.]+)", output)
        return Row(case, "ok", float(re.search(r"samples/s ([\d.]+)", output)[1]),
                   peak_gib=float(peak[1]) if peak else None, notes="bf16, channels-last")

    def preflight(self) -> Row:
        ok, output = self.command(self.torchrun("-m", "ddp_training.preflight", "--device", self.settings.device))
        backend = "nccl" if self.settings.device == "cuda" else "gloo"
        return Row("preflight", "ok" if ok and "PASS" in output else "FAIL",
                   notes=backend if ok else last_error(output))

    def host_syncs_per_step(self) -> Row:
        # The difference between two run lengths, so that start-up and the final save cancel out. On CPU there
        # is nothing to count: a dry run counts in the channels-last row's run, to check that the counting works.
        if self.dry_run:
            if not self.sync_count.exists():
                return Row("host syncs per step", "FAIL", notes="the channels-last run counted nothing")
            return Row("host syncs per step", "n/a",
                       notes=f"CUDA only; counted {int(self.sync_count.read_text())} on CPU")
        lengths = (10, 20)
        counts = []
        for steps in lengths:
            name = f"syncs-{steps}"
            count_file = self.scratch / f"{name}.count"
            args = self.train_args(name, "--log-every", "100000", steps=steps)
            ok, output = self.command(self.torchrun(str(Path(__file__).resolve()), SYNC_COUNT_FLAG, str(count_file),
                                                    *args))
            if not ok:
                return Row("host syncs per step", "FAIL", notes=last_error(output))
            counts.append(int(count_file.read_text()))
        if self.settings.device != "cuda":
            return Row("host syncs per step", "n/a", notes=f"CUDA only; counted {counts[-1]} on CPU")
        (short, long), (short_count, long_count) = lengths, counts
        per_step = (long_count - short_count) / (long - short)
        notes = (f"{per_step:g} per step ({short_count} in {short} steps, {long_count} in {long}, "
                 "--log-every beyond the run)")
        # One: the non-finite check's read of the ranks' agreement, before each update (a NaN step is never taken).
        return Row("host syncs per step", "ok" if per_step == 1 else "FAIL", notes=notes)

    def bitwise_resume(self) -> Row:
        case = "bitwise resume (dropout)"
        dropout = ["--model", "mobilenet_v3_small", "--image-size", "32", "--batch-size", "32", "--deterministic",
                   "--keep-checkpoints", "10", "--ckpt-every", "4"]
        whole, halves = self.scratch / "resume-whole", self.scratch / "resume-halves"

        def train_to_step_8(folder: Path) -> tuple[bool, str]:
            return self.command(self.torchrun("train.py", *self.train_args(folder.name, *dropout, steps=8)))
        ok, output = train_to_step_8(whole)
        if ok:  # halves resumes from a copy of whole's step 4: a run stopped there
            (halves / "checkpoints").mkdir(parents=True)
            shutil.copy(whole / "checkpoints" / "step-4.pt", halves / "checkpoints")
            ok, output = train_to_step_8(halves)
        if not ok:
            return Row(case, "FAIL", notes=last_error(output))
        if "resuming from" not in output:
            return Row(case, "FAIL", notes="the second run did not resume")
        import torch  # here: the rows above need no torch in this process

        def load(folder: Path) -> dict:
            return torch.load(folder / "checkpoints" / "step-8.pt", weights_only=True)
        expected, actual = load(whole), load(halves)
        differing = [name for name, tensor in expected["model"].items()
                     if not torch.equal(tensor, actual["model"][name])]
        generators = len(actual["cuda_rng_states"][0])
        notes = f"mobilenet_v3_small, --deterministic; CUDA generator state saved: {generators} bytes"
        if differing:
            return Row(case, "FAIL", notes=f"{len(differing)} tensors differ, first {differing[0]}; {notes}")
        return Row(case, "ok", notes=f"8 steps = 4 + resumed 4; {notes}")


def last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    # The worker's own exception line, not torchrun's ChildFailedError summary after it.
    errors = [line for line in lines if re.match(r"(\w+Error|\w+Exception|error|preflight FAIL|timed out)\b", line)]
    return (errors or lines or ["no output"])[-1][:160].replace("|", "/")


def ratio(row: Row, baseline: Row, goal: str) -> str:
    if row.images_per_second and baseline.images_per_second:
        return f"{row.images_per_second / baseline.images_per_second:.3f}x {baseline.case} (goal {goal})"
    return ""


def run_check(dry_run: bool) -> list[Row]:
    settings = Settings.for_run(dry_run)
    project = bake_default_project(use_preflight="yes")  # its first row
    check = Check(project, settings, dry_run)
    check.scratch.mkdir()
    print(f"baked {project}; {settings}", flush=True)
    rows = [check.preflight()]
    compute = check.baseline("pure compute", "compute")
    bare = check.baseline("bare DDP loop", "bare")
    if dry_run:  # rows that differ from the others only in flags the suite covers: a launch each, saved on CPU
        same = "not in a dry run: the same path as the channels-last row"
        fp32, bf16 = Row("train.py fp32", "n/a", notes=same), Row("train.py bf16", "n/a", notes=same)
    else:
        fp32 = check.train("train.py fp32", "--precision", "fp32", "--no-channels-last")
        bf16 = check.train("train.py bf16", "--precision", "bf16", "--no-channels-last")
    channels_last = check.train("train.py bf16 channels-last", "--precision", "bf16", "--channels-last",
                                count_syncs_into=check.sync_count if dry_run else None)
    channels_last.versus = (ratio(channels_last, bare, ">= 1.0") + "; "
                            + ratio(channels_last, compute, ">= 0.95")).strip("; ")
    if dry_run:  # inductor's C++ build takes minutes on a small CPU; the flag itself is covered by the suite
        compiled = Row("train.py bf16 channels-last compile", "n/a", notes="not in a dry run")
    else:
        compiled = check.train("train.py bf16 channels-last compile", "--precision", "bf16", "--channels-last",
                               "--compile")
        compiled.versus = ratio(compiled, bare, ">= 1.0")
    if dry_run:  # FSDP2 with these flags on CPU: test_fsdp.py in the suite
        fsdp = Row("fsdp2 bf16", "n/a", notes="not in a dry run: the same path as the channels-last row")
        fsdp_channels_last = Row("fsdp2 bf16 channels-last", "n/a",
                                 notes="not in a dry run: the same path as the channels-last row")
    else:
        fsdp = check.train("fsdp2 bf16", "--strategy", "fsdp2", "--precision", "bf16", "--no-channels-last")
        fsdp_channels_last = check.train("fsdp2 bf16 channels-last", "--strategy", "fsdp2", "--precision", "bf16",
                                         "--channels-last")
        fsdp_channels_last.versus = ratio(fsdp_channels_last, channels_last, "about 1")
    rows += [compute, bare, fp32, bf16, channels_last, compiled, fsdp, fsdp_channels_last,
             check.host_syncs_per_step(), check.bitwise_resume()]
    return rows


def table(rows: list[Row], dry_run: bool) -> str:
    s = Settings.for_run(dry_run)
    where = "dry run: CPU, gloo" if dry_run else "1 GPU, NCCL"
    lines = [f"GPU check ({where}; {s.model}, {s.image_size} px, batch {s.batch_size}, {s.steps} steps, "
             f"{s.num_workers} loader workers, 1 rank)", "",
             "| case | status | img/s | ratio | peak GiB | notes |", "| --- | --- | --- | --- | --- | --- |"]
    return "\n".join(lines + [row.markdown() for row in rows]) + "\n"


def count_host_syncs(count_file: str, train_args: list[str]) -> None:
    """Run train.py in this (torchrun-started) process with CUDA's sync debug mode on, and write how many
    synchronizing CUDA calls it warned about."""
    import torch

    count = 0
    def counted(message, *args, **kwargs):
        nonlocal count
        count += "synchroniz" in str(message)
    warnings.simplefilter("always")
    warnings.showwarning = counted
    if torch.cuda.is_available():  # it starts CUDA; without it, the count stays 0 (a dry run checks the plumbing)
        torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["train.py", *train_args]
    sys.path.insert(0, str(Path.cwd()))
    try:
        runpy.run_path("train.py", run_name="__main__")
    finally:
        Path(count_file).write_text(str(count))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == SYNC_COUNT_FLAG:
        count_host_syncs(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.md", help="also write the table here")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes: checks the script runs")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run_check(args.dry_run)
    text = table(rows, args.dry_run)
    Path(args.out).write_text(text)
    print(text, flush=True)
    print(f"{time.perf_counter() - started:.0f} s; table written to {args.out}")
    sys.exit(1 if any(row.status == "FAIL" for row in rows) else 0)


if __name__ == "__main__":
    main()
