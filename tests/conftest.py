"""Fixtures (the baked projects, the shared reference run) and pytest hooks; the helpers the tests share are in
helpers/, by concern."""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import resource
import shutil
import sys
from pathlib import Path

import pytest
from helpers import bare_torchrun


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which tags each grouped test with its group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest work first, so that `make test`'s xdist workers finish together instead of one running a long
    test alone at the end: the GPU check's dry run (about 50 s of CPU), then the xdist groups (each is one
    worker's work, test after test), then the other torchrun tests, then the in-process ones."""
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        assert not lost, f"pytest-xdist did not group {lost[0]} (pytest-xdist#1386): use the pinned pytest"

    def order(item: pytest.Item) -> int:
        markers = ("starts_first", "xdist_group", "slow")
        return next((rank for rank, name in enumerate(markers) if item.get_closest_marker(name)), len(markers))
    items.sort(key=order)  # stable: within a rank, the order of the files


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-top", type=int, default=15, metavar="N",
                     help="list the N tests that cost the most CPU-seconds (their processes' user + sys)")


def _cpu_seconds() -> float:
    """This process's CPU time and that of every descendant it waited for (torchrun and its ranks)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Charge each test the CPU-seconds of its setup, call and teardown (the suite's budget is CPU, not wall
    clock on a shared machine); the teardown's report carries the figure, also from an xdist worker."""
    started = _cpu_seconds()
    item.user_properties.append(("cpu_started", started))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.when == "teardown":
        started = dict(item.user_properties)["cpu_started"]
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - started))
    return report


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    costs = [(dict(report.user_properties)["cpu_seconds"], report.nodeid)
             for reports in terminalreporter.stats.values() for report in reports
             if getattr(report, "when", None) == "teardown" and "cpu_seconds" in dict(report.user_properties)]
    if not costs or config.option.cpu_top <= 0:
        return
    terminalreporter.section(f"CPU-seconds: {sum(c for c, _ in costs):.0f} in {len(costs)} tests; the most costly")
    for seconds, nodeid in sorted(costs, reverse=True)[:config.option.cpu_top]:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")


@pytest.fixture(scope="session")
def default_project(cookies_session) -> Path:
    """The project baked with every default answer, shared by the tests that only read or run it."""
    result = cookies_session.bake()
    assert result.exit_code == 0, result.exception
    return result.project_path


# The optional parts with Python of their own, which the default bake leaves out.
OPTIONAL_PARTS = {"use_preflight": "yes", "use_profiling": "yes", "use_export": "yes", "use_trackers": "yes"}


@pytest.fixture(scope="session")
def full_project(cookies_session) -> Path:
    """The default project with every optional part of its own Python (preflight, profiling, export, trackers),
    shared by the tests of those parts and by the tests that import the package into this process."""
    result = cookies_session.bake(extra_context=OPTIONAL_PARTS)
    assert result.exit_code == 0, result.exception
    return result.project_path


@pytest.fixture(scope="session")
def bake(cookies_session):
    """Bake with extra answers; fails the test if baking fails."""
    def _bake(**answers: str) -> Path:
        result = cookies_session.bake(extra_context=answers)
        assert result.exit_code == 0, f"baking {answers} failed: {result.exception}"
        return result.project_path
    return _bake


@pytest.fixture
def baked_module(full_project, monkeypatch):
    """Import a module of the full project's package into this process (what needs no torch.distributed)."""
    monkeypatch.syspath_prepend(str(full_project))
    return lambda name: importlib.import_module(f"ddp_training.{name}")


@pytest.fixture(scope="session")
def baked_train(full_project):
    """The full project's train.py imported into this process (with the package baked_module imports), so that
    what main(argv) does before training starts (--help, a usage error) is checked without starting a Python
    process (importing torch takes seconds)."""
    sys.path.insert(0, str(full_project))
    spec = importlib.util.spec_from_file_location("baked_train", full_project / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(full_project))


@pytest.fixture(scope="session")
def uninterrupted_bare(default_project, tmp_path_factory, worker_id) -> Path:
    """The reference for the tests that interrupt a BARE run: checkpoints every 4 steps to step 40. Made once
    per session, also under pytest-xdist: the first worker to need it makes it, the others wait on a lock
    in the folder that all of this session's workers share, then read the same files."""
    basetemp = tmp_path_factory.getbasetemp()
    shared = basetemp if worker_id == "master" else basetemp.parent  # .../pytest-N, not .../pytest-N/popen-gwK
    ckpt_dir = shared / "uninterrupted-bare"
    with open(shared / "uninterrupted-bare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if not (ckpt_dir / "complete").exists():
            shutil.rmtree(ckpt_dir, ignore_errors=True)  # what a worker that failed making it left
            launcher = bare_torchrun(default_project, ckpt_dir)
            output = launcher.communicate(timeout=300)[0]
            assert launcher.returncode == 0, output
            (ckpt_dir / "complete").touch()
    return ckpt_dir
