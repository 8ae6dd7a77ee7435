"""What each per-job mechanism costs as the job grows, simulated on one machine, with the fitted exponent and
the extrapolation to 1,024 / 4,096 / 16,384 ranks.

    python benchmarks/scale.py                   # N = 8, 64, 512 (the full mesh stops at 64)
    python benchmarks/scale.py --sizes 8 64 512 2048

Ranks are threads of this process, each with its own gloo process group or store client, over one real store
(torch's HashStore, wrapped to count every request and byte, as rank 0's TCPStore would see them):

- side group: a gloo group of every rank made eagerly (a full mesh, gloo's default; what the stop agreement
  and a stream's own group each made before) and lazily (TORCH_GLOO_LAZY_INIT, what distributed.side_group()
  makes), then one all-reduce, the stop agreement's per-step exchange. Store requests and bytes and open
  sockets per rank; seconds to create the groups and for one all-reduce (all N ranks' work on this machine's
  cores: an upper bound of a real rank's wait, whose own work is the ring's 2(N-1) hops).
- generator states at a save: the table of every rank's CPU generator state as lists of ints (before) and as
  one uint8 tensor (now), through torch.save and torch.load(weights_only=True): seconds on the save's path,
  and again at every load. The all-gather itself is one collective of 5 KB a rank either way.
- hang report: every rank reports at once, as when a rank stops; the baked project's own share_hang_report
  (now) against the loop it replaced (before: each rank checking and reading every rank's key), 8 ranks a
  simulated machine.

A cost per rank with exponent about 0 is O(1); about 1 is O(N) per rank, N^2 at the store.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import math
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import bake_default_project

RANKS_PER_MACHINE = 8
EXTRAPOLATE_TO = (1024, 4096, 16384)


class CountingStore(dist.Store):
    """A store that counts the requests and the bytes of values that go through it, as the one server would."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner, self.requests, self.bytes, self.lock = inner, 0, 0, threading.Lock()

    def _count(self, size: int) -> None:
        with self.lock:
            self.requests += 1
            self.bytes += size

    def set(self, key, value):
        self._count(len(value))
        self.inner.set(key, value)

    def get(self, key):
        value = self.inner.get(key)
        self._count(len(value))
        return value

    def add(self, key, value):
        self._count(8)
        return self.inner.add(key, value)

    def append(self, key, value):
        self._count(len(value))
        self.inner.append(key, value)

    def check(self, keys):
        self._count(0)
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count(0)
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def compare_set(self, key, expected, desired):
        self._count(len(desired))
        return self.inner.compare_set(key, expected, desired)

    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self._count(sum(map(len, values)))
        return values

    def multi_set(self, keys, values):
        self._count(sum(map(len, values)))
        self.inner.multi_set(keys, values)

    def delete_key(self, key):
        self._count(0)
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


def on_every_rank(size: int, work) -> float:
    """Run work(rank) on `size` threads at once; the seconds until the last one ends."""
    errors = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def side_group(size: int, lazy: bool) -> dict[str, float]:
    store = CountingStore(dist.HashStore())
    groups: list[dist.ProcessGroup | None] = [None] * size
    before = open_files()
    with environment("TORCH_GLOO_LAZY_INIT", "1" if lazy else None):
        def create(rank: int) -> None:
            groups[rank] = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=300))
        created = on_every_rank(size, create)
    at_creation = (store.requests, store.bytes)

    def all_reduce(rank: int) -> None:
        flag = torch.zeros(1)
        groups[rank].allreduce([flag]).wait()
    first = on_every_rank(size, all_reduce)  # lazily: connects the ring
    again = on_every_rank(size, all_reduce)
    result = {"store requests": store.requests / size, "store bytes": store.bytes / size,
              "sockets": (open_files() - before) / size, "creation s": created, "first all-reduce s": first,
              "all-reduce s": again, "store requests at creation": at_creation[0] / size}
    groups.clear()  # gloo's threads end with their groups
    return result


@contextlib.contextmanager
def environment(name: str, value: str | None):
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def generator_states(size: int, as_lists: bool) -> dict[str, float]:
    row = torch.get_rng_state()
    table = row.repeat(size, 1)
    started = time.perf_counter()
    if as_lists:  # what gather_rng_states returned before: an int64 table made into lists
        rows = table.to(torch.int64).tolist()
        state = {"cpu_rng_states": rows, "cuda_rng_states": [[] for _ in rows]}
    else:
        state = {"cpu_rng_states": table.clone(), "cuda_rng_states": table[:, :0].clone()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    saved = time.perf_counter() - started
    buffer.seek(0)
    started = time.perf_counter()
    torch.load(buffer, weights_only=True)
    return {"save s": saved, "load s": time.perf_counter() - started, "bytes": buffer.getbuffer().nbytes / size}


def hang_report(size: int, watchdog, before: bool) -> dict[str, float]:
    """Every rank reports at once. `before`: the loop share_hang_report replaced."""
    store = CountingStore(dist.HashStore())
    store.set_timeout(timedelta(seconds=60))
    for rank in range(size):  # what each Watchdog publishes at its start (not counted: not the report's)
        host = f"machine-{rank // RANKS_PER_MACHINE}"
        if before:
            store.inner.set(f"ddp-template/process/{rank}", f"{host} {rank} unknown")
        else:
            store.inner.append(watchdog.processes_key(host), f"{rank} {host} {rank} unknown\n")
    report = {"step": 10, "phase": "training step", "stalled_s": 600, "waiting_for_others": True}
    summaries = []

    def share(rank: int) -> None:
        host = f"machine-{rank // RANKS_PER_MACHINE}"
        if before:
            summaries.append(old_share_hang_report(store, rank, size, report, watchdog))
        else:
            summaries.append(watchdog.share_hang_report(store, rank, size, {**report, "rank": rank}, window=0.5,
                                                        flight_records=Path("hang-reports"), host=host))
    seconds = on_every_rank(size, share) - 0.5
    printed = [summary for summary in summaries if summary]
    assert len(printed) == 1 and printed[0].startswith("HANG: every rank waits"), printed[:2]
    return {"store requests": store.requests / size, "store bytes": store.bytes / size, "seconds": seconds,
            "summary chars": len(printed[0])}


def old_share_hang_report(store: dist.Store, rank: int, size: int, report: dict, watchdog) -> str | None:
    """The report as it was shared before: every rank checked and read every rank's key, then checked and read
    the process key of every silent rank; the lowest live rank printed the summary."""
    prefix = "ddp-template/hang-report/"
    store.set(f"{prefix}{rank}", json.dumps({**report, "rank": rank}))
    time.sleep(0.5)
    reports = {other: json.loads(store.get(f"{prefix}{other}")) for other in range(size)
               if store.check([f"{prefix}{other}"])}
    silent = [other for other in range(size) if other not in reports]
    for other in silent:
        if store.check([f"ddp-template/process/{other}"]):
            store.get(f"ddp-template/process/{other}")
    return watchdog.hang_summary(reports, silent, Path("hang-reports")) if min(reports) == rank else None


def exponent(sizes: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) over log(N)."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v > 0]
    if len(points) < 2:
        return float("nan")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return (sum((x - mean_x) * (y - mean_y) for x, y in points)
            / sum((x - mean_x) ** 2 for x, _ in points))


def table(title: str, rows: dict[int, dict[str, float]], costs: list[str]) -> str:
    sizes = sorted(rows)
    head = [f"N={n:,}" for n in sizes] + ["exponent"] + [f"~{n:,}" for n in EXTRAPOLATE_TO]
    lines = [f"### {title}", "", "| cost | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for cost in costs:
        values = [rows[n][cost] for n in sizes]
        slope = exponent(sizes, values)
        projected = [values[-1] * (n / sizes[-1]) ** slope if not math.isnan(slope) else float("nan")
                     for n in EXTRAPOLATE_TO]
        lines.append(f"| {cost} | " + " | ".join(figure(v) for v in values) + f" | {slope:.2f} | "
                     + " | ".join(figure(v) for v in projected) + " |")
    return "\n".join(lines) + "\n"


def figure(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--rng-sizes", type=int, nargs="+", default=[8, 64, 512, 1024, 4096])
    parser.add_argument("--mesh-up-to", type=int, default=64, help="largest N for the eager full mesh")
    parser.add_argument("--json", help="also write every figure here, {table: {N: {cost: value}}}")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the full mesh of N threads holds N(N-1) ends
    torch.set_num_threads(1)
    project = bake_default_project()
    sys.path.insert(0, str(project))
    from ddp_training.engine import watchdog

    print(f"torch {torch.__version__}; {os.cpu_count()} cores; ranks are threads of one process\n")
    side = ["store requests", "store bytes", "sockets", "creation s", "all-reduce s"]
    rng = ["save s", "load s", "bytes"]
    hang = ["store requests", "store bytes", "seconds", "summary chars"]
    tables = {
        "Side group, eager (full mesh): before": (side, lambda n: side_group(n, lazy=False),
                                                  [n for n in args.sizes if n <= args.mesh_up_to]),
        "Side group, lazy (ring): now": (side, lambda n: side_group(n, lazy=True), args.sizes),
        "Generator states as lists of ints: before": (rng, lambda n: generator_states(n, True), args.rng_sizes),
        "Generator states as one uint8 tensor: now": (rng, lambda n: generator_states(n, False), args.rng_sizes),
        "Hang report: before": (hang[:3], lambda n: hang_report(n, watchdog, before=True), args.sizes),
        "Hang report: now": (hang, lambda n: hang_report(n, watchdog, before=False), args.sizes),
    }
    results = {}
    for title, (costs, measure, sizes) in tables.items():
        results[title] = {n: measure(n) for n in sizes}
        print(table(title, results[title], costs), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("Per rank, except seconds: until the last of the N simulated ranks was done; exponent: the slope of "
          "log(cost) over log(N); ~N: extrapolated along it.")
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    sys.stdout.flush()
    atexit._run_exitfuncs()  # os._exit runs none: the bake's removal (scratch_dir) among them
    os._exit(0)  # gloo's threads of the groups made here need not be joined


if __name__ == "__main__":
    main()
