"""Replica groups on torchft, ahead of the opt-in mode where survivors keep training: what a group of several
processes needs so that a group killed and restarted heals into the same model as the survivors.

Not the template's code: a model and loop of its own (an MLP, SGD with momentum, per-rank random batches), the
shape the mode would take inside train.py. Each group is one torchrun with 2 ranks (a machine); inside it, torch
DDP all-reduces on the group's own process group; across groups, a DDP comm hook averages each bucket over the
groups that take part in the step, through the torchft Manager (torchft's own DDP all-reduces across groups only:
with more than one process per group its ranks would average different gradient sets). A torchft Lighthouse
(min_replicas 1, heartbeat timeout 1 s) forms the quorums.

    pip install torchft-nightly==2026.10.26  # torchft 0.2.0's DDP hook fails the survivor (meta-pytorch/torchft#369)
    python benchmarks/torchft_groups.py --trials 5                  # kill -9 a rank of group 1 after step 20
    python benchmarks/torchft_groups.py --trials 1 --rebuild-buckets   # DDP's default: the groups diverge
    python benchmarks/torchft_groups.py --trials 1 --launcher-store    # the Manager's keys in torchrun's store

Each trial prints: the steps the survivor did not commit, its longest stall after the kill (the longest gap
between its commits, less its median step), the restart's heal (the step it healed at, seconds after the kill),
and whether both groups end with bitwise equal weights and momentum.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

STEPS, KILL_AFTER, STEP_SECONDS = 250, 20, 0.1


def digest(model, optimizer) -> str:
    hashed = hashlib.sha256()
    for parameter in model.parameters():
        hashed.update(parameter.detach().numpy().tobytes())
        momentum = optimizer.state.get(parameter, {}).get("momentum_buffer")
        hashed.update(b"-" if momentum is None else momentum.numpy().tobytes())
    return hashed.hexdigest()[:16]


def worker() -> None:
    """One rank of one replica group, under torchrun."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torchft.manager import Manager, _ManagedFuture
    from torchft.process_group import ProcessGroupGloo

    group, rank, world = (int(os.environ[name]) for name in ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE"))
    # torchrun's store outlives a restart of the group, and keys an earlier attempt left in it send a restarted
    # rank to dead peers (pytorch/pytorch#135712; the Manager's server address is one): the group's process
    # group and its Manager meet in a store of this attempt's own, as the project's distributed_session does.
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if os.environ.get("LAUNCHER_STORE"):
        own, port = launcher, int(os.environ["MASTER_PORT"])
    else:
        if rank == 0:
            own = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            launcher.set(f"attempt_store_{attempt}", str(own.port))
        port = int(launcher.get(f"attempt_store_{attempt}"))
        own = own if rank == 0 else dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group_{attempt}", own) if not os.environ.get(
        "LAUNCHER_STORE") else None, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    progress = {"step": 0}

    def load_state_dict(state) -> None:  # a heal: what a checkpoint would hold, from a running group
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        progress.update(state["progress"])
        print(f"HEALED {group} {rank} {progress['step']} {time.time():.3f}", flush=True)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "progress": dict(progress)}

    store = {"store_addr": "127.0.0.1" if not os.environ.get("LAUNCHER_STORE") else os.environ["MASTER_ADDR"],
             "store_port": port}
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"group{group}",
                      rank=rank, world_size=world, use_async_quorum=False, timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=20), **store)
    # find_unused_parameters=True keeps DDP from rebuilding its buckets after the first step (torchft's own DDP
    # does the same): a group that joins late would otherwise average its first-step bucket layout against the
    # running groups' rebuilt one, gradient of one parameter against another's.
    ddp = DistributedDataParallel(model, find_unused_parameters=not os.environ.get("REBUILD_BUCKETS"))

    def average_in_group_then_across_groups(state, bucket):
        buffer = bucket.buffer()
        dist.all_reduce(buffer)  # the group's own ranks
        buffer /= world
        work = manager.allreduce(buffer)  # the mean over the groups in this step's quorum
        if not work.wait():  # a peer was lost: this step is not committed anywhere
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        future = work.get_future()  # the chain that divides by the participants, as torchft's DDP returns it
        return future._fut if isinstance(future, _ManagedFuture) else future

    ddp.register_comm_hook(None, average_in_group_then_across_groups)
    while progress["step"] < STEPS:
        manager.start_quorum()
        draws = torch.Generator().manual_seed(progress["step"] * 1000 + group * world + rank)
        inputs = torch.randn(16, 8, generator=draws)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), inputs.sum(dim=1, keepdim=True)).backward()
        time.sleep(STEP_SECONDS)  # a slower step, so that the kill lands between a backward and its commit
        if manager.should_commit():
            optimizer.step()
            progress["step"] += 1
            print(f"COMMIT {group} {rank} {progress['step']} {manager.num_participants()} {time.time():.3f} "
                  f"{digest(model, optimizer)}", flush=True)
        else:
            print(f"SKIPPED {group} {rank} {progress['step']} {time.time():.3f}", flush=True)
    print(f"FINAL {group} {rank} {digest(model, optimizer)}", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def trial(arguments: argparse.Namespace, folder: Path) -> dict:
    lighthouse_port = free_port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
                                   "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "1000",
                                   "--bind", f"[::]:{lighthouse_port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    environment = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{lighthouse_port}", "BENCH_WORKER": "1",
                   **({"REBUILD_BUCKETS": "1"} if arguments.rebuild_buckets else {}),
                   **({"LAUNCHER_STORE": "1"} if arguments.launcher_store else {})}
    logs = [folder / f"group{group}.log" for group in (0, 1)]
    groups = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                "--max-restarts=3", __file__], env={**environment, "REPLICA_GROUP_ID": str(group)},
                               stdout=log.open("w"), stderr=subprocess.STDOUT) for group, log in enumerate(logs)]
    deadline = time.monotonic() + 120
    while f"COMMIT 1 1 {KILL_AFTER} " not in logs[1].read_text():
        assert time.monotonic() < deadline and groups[1].poll() is None, logs[1].read_text()[-3000:]
        time.sleep(0.02)
    victim = next(int(pid) for pid in subprocess.run(["pgrep", "-f", __file__], capture_output=True,
                                                      text=True).stdout.split()
                  if b"REPLICA_GROUP_ID=1\0" in Path(f"/proc/{pid}/environ").read_bytes()
                  and b"LOCAL_RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes())
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    for process in groups:
        process.wait(timeout=300)
    lighthouse.terminate()
    survivor, restarted = (log.read_text() for log in logs)
    # Not anchored to a line: two ranks' prints can share one line of a group's log.
    commits = [float(t) for t in re.findall(r"COMMIT 0 0 \d+ \d+ (\d+\.\d{3}) [0-9a-f]{16}", survivor)]
    gaps = [later - earlier for earlier, later in zip(commits, commits[1:], strict=False)]
    after = [later - earlier for earlier, later in zip(commits, commits[1:], strict=False) if later > killed_at]
    healed = re.findall(r"HEALED 1 0 (\d+) (\d+\.\d{3})", restarted)
    late = [(int(step), float(at)) for step, at in healed if float(at) > killed_at]
    finals = re.findall(r"FINAL \d \d ([0-9a-f]{16})", survivor + restarted)
    # The first step at which the restarted group's weights and momentum differ from the survivor's, if any.
    steps = [dict(re.findall(rf"COMMIT {group} 0 (\d+) \d+ \d+\.\d{{3}} ([0-9a-f]{{16}})", log))
             for group, log in enumerate((survivor, restarted))]
    healed_step = int(late[0][0]) if late else None
    differ = sorted(int(step) for step, hashed in steps[1].items()
                    if healed_step is not None and int(step) > healed_step and steps[0].get(step) not in (None, hashed))
    return {"skipped": len(re.findall(r"SKIPPED 0 0 ", survivor)),
            "stall": max(after) - statistics.median(gaps) if after else None,
            "healed_at": late[0][0] if late else None, "heal_after": late[0][1] - killed_at if late else None,
            "equal": len(finals) == 4 and len(set(finals)) == 1, "ranks_finished": len(finals),
            "first_step_apart": differ[0] if differ else None,
            "restarts": restarted.count("failed (exitcode")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rebuild-buckets", action="store_true", help="DDP's default bucket rebuild after step 1")
    parser.add_argument("--launcher-store", action="store_true", help="the Manager's keys in torchrun's own store")
    parser.add_argument("--logs", type=Path, help="keep each trial's group logs in this folder")
    arguments = parser.parse_args()
    results = []
    for number in range(arguments.trials):
        with tempfile.TemporaryDirectory() as scratch:
            folder = arguments.logs / f"trial-{number + 1}" if arguments.logs else Path(scratch)
            folder.mkdir(parents=True, exist_ok=True)
            results.append(trial(arguments, folder))
        print(f"trial {number + 1}: {results[-1]}", flush=True)
    stalls = [result["stall"] for result in results if result["stall"] is not None]
    heals = [result["heal_after"] for result in results if result["heal_after"] is not None]
    print(f"survivor's stall after the kill: median {statistics.median(stalls):.2f} s, {min(stalls):.2f}-"
          f"{max(stalls):.2f}" if stalls else "survivor's stall: none measured")
    print(f"heal after the kill: median {statistics.median(heals):.2f} s, {min(heals):.2f}-{max(heals):.2f}"
          if heals else "heal: none")
    print(f"groups bitwise equal at the end: {sum(result['equal'] for result in results)} of {len(results)}")


if __name__ == "__main__":
    worker() if os.environ.get("BENCH_WORKER") else main()
