"""Two real hosts: Linux network namespaces with their own addresses, joined by a bridge, each running the
generated run_node.sh unchanged. The hostname resolves to neither address, as in containers, so this is
where torchrun's own guesses (store host, MASTER_ADDR) go wrong and run_node.sh's must be right."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    assert_bitwise_equal,
    bare_torchrun,
    checkpoint,
    flags,
    paused,
    require,
    start_job,
    tool_env,
    wait_for,
    worker_pids,
)

SUBNET = "10.213.77"  # private, used only inside the namespaces this module creates
TINY = flags(data="fake", fake_samples=256, image_size=16, batch_size=16, num_workers=0, device="cpu", log_every=2)

pytestmark = [require(os.geteuid() == 0 and shutil.which("ip") is not None,
                      "needs root and iproute2 to create network namespaces"), pytest.mark.slow,
              pytest.mark.xdist_group("namespaces")]


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """[(namespace, address)] for two hosts behind one bridge; removed afterwards."""
    tag = str(os.getpid() % 100000)
    switch, names = f"ddpsw{tag}", [f"ddph{k}n{tag}" for k in range(2)]
    created = []
    try:
        for namespace in (switch, *names):
            sh("ip", "netns", "add", namespace)
            created.append(namespace)
            sh("ip", "-n", namespace, "link", "set", "lo", "up")
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        for k, namespace in enumerate(names):
            host_end, switch_end = f"ddp{k}h{tag}", f"ddp{k}s{tag}"
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            sh("ip", "link", "set", host_end, "netns", namespace)
            sh("ip", "link", "set", switch_end, "netns", switch)
            sh("ip", "-n", switch, "link", "set", switch_end, "master", "br0", "up")
            sh("ip", "-n", namespace, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", host_end)
            sh("ip", "-n", namespace, "link", "set", host_end, "up")
        yield [(namespace, f"{SUBNET}.{k + 1}") for k, namespace in enumerate(names)]
    finally:
        for namespace in created:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def start_on_host(namespace: str, project: Path, args: list[str], **launch: object) -> subprocess.Popen:
    """./run_node.sh on the host that is this network namespace."""
    return start_job(project, args, via="run_node.sh", prefix=("ip", "netns", "exec", namespace), **launch)


def finish(nodes: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Each node's output once all have exited; past the timeout, every node's whole session is killed."""
    try:
        return [node.communicate(timeout=timeout)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL) if os.getsid(node.pid) == node.pid else node.kill()
        raise


def test_a_node_that_never_arrives_is_a_clear_timeout(default_project, hosts, tmp_path):
    namespace, address = hosts[0]
    [output] = finish([start_on_host(namespace, default_project, [*TINY, "--ckpt-dir", str(tmp_path)],
                                     NNODES="2", nproc=1, RDZV_ENDPOINT=f"{address}:29401",
                                     RDZV_ID="alone", RDZV_TIMEOUT="8")], timeout=120)
    assert "RendezvousTimeoutError" in output, output
    assert not list(tmp_path.glob("step-*.pt"))


def test_a_taken_port_on_the_endpoint_is_a_clear_error(default_project, hosts):
    namespace, address = hosts[0]
    squatter = subprocess.Popen(
        ["ip", "netns", "exec", namespace, "python3", "-c",
         f"import socket, time; s = socket.create_server(('{address}', 29404)); print('listening', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "listening"
        [output] = finish([start_on_host(namespace, default_project, TINY, NNODES="2", nproc=1,
                                         RDZV_ENDPOINT=f"{address}:29404", RDZV_ID="late")], timeout=60)
    finally:
        squatter.kill()
    assert output.strip() == (f"run_node.sh: error: port 29404 is already taken on this machine ({address}), the "
                              "rendezvous endpoint; another job may be using it: choose another port in RDZV_ENDPOINT")


def test_another_rdzv_id_on_the_same_endpoint_does_not_join(default_project, hosts, tmp_path):
    endpoint = f"{hosts[0][1]}:29402"
    nodes = [start_on_host(namespace, default_project, [*TINY, "--ckpt-dir", str(tmp_path / rdzv_id)],
                           NNODES="2", nproc=1, RDZV_ENDPOINT=endpoint, RDZV_ID=rdzv_id,
                           RDZV_TIMEOUT="8")
             for (namespace, _), rdzv_id in zip(hosts, ("job-a", "job-b"), strict=True)]
    outputs = finish(nodes, timeout=120)
    assert all(node.returncode != 0 for node in nodes), outputs
    assert "world_size=" not in "".join(outputs), "the two jobs must never form one"
    # job-a, hosting the store, times out waiting for a second job-a node; job-b times out too, or loses
    # the store when job-a gives up first and takes it down.
    assert "RendezvousTimeoutError" in outputs[0], outputs[0]
    assert "RendezvousTimeoutError" in outputs[1] or "RendezvousConnectionError" in outputs[1], outputs[1]


def test_preflight_passes_across_two_hosts(full_project, hosts):
    endpoint = f"{hosts[0][1]}:29403"
    nodes = [start_on_host(namespace, full_project, ["--preflight", "--device", "cpu", "--megabytes", "8"],
                           NNODES="2", nproc=2, RDZV_ENDPOINT=endpoint, RDZV_ID="preflight")
             for namespace, _ in hosts]
    outputs = finish(nodes)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    summary = "".join(outputs)
    # Its DDP model, freed at exit after the group was destroyed, aborted about 4 runs in 10 at exit (SIGABRT).
    assert "terminate called" not in summary, summary
    for check in ("rank map", "devices", "all-reduce result", "all-reduce bandwidth", "training steps"):
        assert f"preflight PASS {check}: " in summary, summary
    assert "preflight PASS rank map: 4 ranks on 2 nodes" in summary
    assert "all-reduce result: sum over ranks = 10, expected 10" in summary
    assert "preflight PASS: world_size=4 nodes=2 device=cpu" in summary
    print(next(line for line in summary.splitlines() if "all-reduce bandwidth" in line))  # the figure, with -s


def test_two_hosts_in_an_elastic_range_train_as_one_job(default_project, hosts, tmp_path):
    # NNODES=1:2: the job could start with one host; the second, arriving within torchrun's last-call window
    # (30 s), is admitted into the same job. A fixed NNODES=2 across hosts: the 127.0.1.1 tests below.
    args = [*TINY, "--max-steps", "4", "--ckpt-every", "2", "--ckpt-dir", str(tmp_path)]
    nodes = [start_on_host(namespace, default_project, args, NNODES="1:2", nproc=2,
                           RDZV_ENDPOINT=f"{hosts[0][1]}:29405", RDZV_ID="elastic") for namespace, _ in hosts]
    outputs = finish(nodes)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert f"this_host={hosts[0][1]} is_endpoint=1" in outputs[0]
    assert f"this_host={hosts[1][1]} is_endpoint=0" in outputs[1]
    assert "world_size=4 nodes=2 ranks_per_node=2" in "".join(outputs)
    assert (tmp_path / "step-4.pt").exists()


@pytest.fixture
def named_hosts(hosts):
    """The two hosts as a cluster's machines are: each has its own hostname (node0, node1), which resolves
    to its address on both (`ip netns exec` reads /etc/netns/<namespace>/hosts as /etc/hosts)."""
    names = "".join(f"{address} node{k}\n" for k, (_, address) in enumerate(hosts))
    for namespace, _ in hosts:
        folder = Path("/etc/netns") / namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(Path("/etc/hosts").read_text() + names)
    try:
        yield [(namespace, f"node{k}") for k, (namespace, _) in enumerate(hosts)]
    finally:
        for namespace, _ in hosts:
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def on_named_host(namespace: str, hostname: str) -> tuple[str, ...]:
    """A command prefix that runs on this namespace host under its own hostname (a UTS namespace of its own)."""
    return ("ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname)


def test_bare_c10d_torchrun_on_two_hosts_recovers_from_kill_9_bitwise(
        default_project, named_hosts, uninterrupted_bare, tmp_path):
    # The card's command on each machine, nothing exported: before the fresh store per attempt, restarted
    # workers met the dead group's keys in torchrun's shared store.
    rendezvous = ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29406",
                  "--rdzv-id=bare-two-hosts")
    nodes = [bare_torchrun(default_project, tmp_path, nproc=1, max_restarts=1, rendezvous=rendezvous,
                           prefix=on_named_host(namespace, hostname))
             for namespace, hostname in named_hosts]
    wait_for(tmp_path / "step-8.pt", nodes[0])
    with paused(*nodes):
        os.kill(worker_pids(nodes[1])[0], signal.SIGKILL)
    outputs = finish(nodes)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # Two attempts, logged by rank 0 wherever the new round put it. The killed worker's torchrun counts a
    # restart; the other restarts its healthy worker without counting one: restart counts now differ, which
    # is where torch's per-restart key prefix fails (pytorch#135712).
    assert "".join(outputs).count("world_size=2 nodes=2 ranks_per_node=1 backend=gloo") == 2, outputs
    assert "resuming from" in "".join(outputs), outputs
    assert "forcefully exiting via 9" not in "".join(outputs)
    assert_bitwise_equal(checkpoint(tmp_path, 40), checkpoint(uninterrupted_bare, 40))


@pytest.fixture
def debian_hosts(hosts):
    """The two hosts as Debian and Ubuntu install them: each maps its own hostname to 127.0.1.1 in /etc/hosts
    and the other's to its address. [(namespace, hostname, interface)]."""
    tag = hosts[0][0].rsplit("n", 1)[1]
    for k, (namespace, _) in enumerate(hosts):
        other, (_, other_address) = 1 - k, hosts[1 - k]
        folder = Path("/etc/netns") / namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 node{k}\n{other_address} node{other}\n")
    try:
        yield [(namespace, f"node{k}", f"ddp{k}h{tag}") for k, (namespace, _) in enumerate(hosts)]
    finally:
        for namespace, _ in hosts:
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def test_bare_c10d_torchrun_trains_on_hosts_that_map_their_name_to_127_0_1_1(default_project, debian_hosts, tmp_path):
    # gloo itself needs the interface there (it would take the hostname's 127.0.1.1), so the user exports it;
    # the job must then publish the endpoint machine's name, not the loopback address its route finds.
    rendezvous = ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29407",
                  "--rdzv-id=debian-hosts")
    nodes = [bare_torchrun(default_project, tmp_path, "--max-steps", "4", nproc=1, rendezvous=rendezvous,
                           prefix=on_named_host(namespace, hostname), GLOO_SOCKET_IFNAME=interface)
             for namespace, hostname, interface in debian_hosts]
    outputs = finish(nodes, timeout=100)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "world_size=2 nodes=2 ranks_per_node=1" in "".join(outputs)


def test_run_node_on_hosts_that_map_their_name_to_127_0_1_1(default_project, debian_hosts, hosts, tmp_path):
    args = [*TINY, "--max-steps", "2", "--ckpt-dir", str(tmp_path)]
    nodes = [start_job(default_project, args, via="run_node.sh", nproc=1, prefix=on_named_host(namespace, hostname),
                       NNODES="2", RDZV_ENDPOINT="node0:29408", RDZV_ID="debian-run-node")
             for namespace, hostname, _ in debian_hosts]
    outputs = finish(nodes, timeout=100)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # The endpoint's name resolves to 127.0.1.1 on the endpoint itself: still the machine the others reach.
    assert f"this_host={hosts[0][1]} is_endpoint=1 gloo_ifname={debian_hosts[0][2]}" in outputs[0], outputs[0]
    assert f"this_host={hosts[1][1]} is_endpoint=0" in outputs[1], outputs[1]


def test_the_static_form_without_node_rank_waits_in_torchrun_before_any_worker_starts(
        default_project, named_hosts, tmp_path):
    # What the generated README warns of: the card's command without --rdzv-backend=c10d makes both machines
    # node 0 of torchrun's static rendezvous, and both torchruns wait without starting train.py, so the project
    # cannot report it; if torchrun ever reports it itself, this fails and the README's warning should change.
    nodes = [subprocess.Popen([*on_named_host(namespace, hostname), "torchrun", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv_endpoint=node0:29409", "train.py", *TINY, "--ckpt-dir", str(tmp_path)],
                              cwd=default_project, env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
             for namespace, hostname in named_hosts]
    time.sleep(15)
    try:
        assert [node.poll() for node in nodes] == [None, None]
        assert not worker_pids(nodes[0]) and not worker_pids(nodes[1])
    finally:
        with pytest.raises(subprocess.TimeoutExpired):
            finish(nodes, timeout=0.1)
