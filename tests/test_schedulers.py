"""Existing engines, optional at bake time: a Slurm batch script run by a real Slurm, and a Kubeflow
PyTorchJob manifest with what the training operator needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from helpers import BARE, assert_bitwise_equal, checkpoint, require, run, stopped, tool_env

SCHEDULER_ANSWERS = [
    ({"use_slurm": "yes", "use_kubernetes": "no"}, {"slurm/train.sbatch"}),
    ({"use_slurm": "no", "use_kubernetes": "no"}, set()),
    ({"use_slurm": "no", "use_kubernetes": "yes"}, {"k8s/pytorchjob.yaml"}),
    ({"use_slurm": "yes", "use_kubernetes": "yes"}, {"slurm/train.sbatch", "k8s/pytorchjob.yaml"}),
]


@pytest.mark.parametrize("answers, scheduler_files", SCHEDULER_ANSWERS,
                         ids=[f"slurm={a['use_slurm']}-k8s={a['use_kubernetes']}" for a, _ in SCHEDULER_ANSWERS])
def test_scheduler_files_follow_the_answers(bake, answers, scheduler_files):
    project = bake(**answers)
    present = {str(path.relative_to(project)) for folder in ("slurm", "k8s") for path in project.glob(f"{folder}/*")}
    assert present == scheduler_files
    assert {path.name for path in project.iterdir() if path.is_dir()} & {"slurm", "k8s"} == \
        {name.split("/")[0] for name in scheduler_files}


@pytest.mark.parametrize("gpus", ["8", "0"])
def test_pytorchjob_has_what_the_operator_needs(bake, gpus):
    project = bake(use_kubernetes="yes", nnodes="2:4", max_restarts="5", gpus_per_node=gpus)
    job = yaml.safe_load((project / "k8s/pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29400, "minReplicas": 2,
                                            "maxReplicas": 4, "maxRestarts": 5}
    assert job["spec"]["nprocPerNode"] == "auto"  # the nproc_per_node answer, not gpus_per_node
    # torchrun (PID 1 in the pod) exits 1 after a usage error's silent retries; the pods restart a bounded number
    # of times, not forever.
    assert job["spec"]["runPolicy"] == {"backoffLimit": 5}
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    [container] = worker["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun", "train.py"]  # torchrun takes the rest from PET_* variables
    # torchrun waits this long for the save after SIGTERM; the pod's grace period is longer.
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "100"} in container["env"]
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] > 100
    limits = container.get("resources", {}).get("limits", {})
    assert limits == ({"nvidia.com/gpu": int(gpus)} if gpus != "0" else {})


DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def test_pytorchjob_names_are_dns_labels_and_use_the_answers(bake):
    project = bake(use_kubernetes="yes", project_slug="my_proj", rdzv_port="29500", nproc_per_node="4")
    job = yaml.safe_load((project / "k8s/pytorchjob.yaml").read_text())
    assert job["metadata"]["name"] == "my-proj"  # the operator refuses my_proj
    claim = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"][0]
    assert DNS_1035_LABEL.fullmatch(claim["persistentVolumeClaim"]["claimName"])
    assert job["spec"]["elasticPolicy"]["rdzvPort"] == 29500 and job["spec"]["nprocPerNode"] == "4"


@pytest.mark.parametrize("answers, cpus", [({"nproc_per_node": "4"}, "#SBATCH --cpus-per-task=12"),
                                           ({"gpus_per_node": "8"}, "#SBATCH --cpus-per-task=24"),
                                           ({"gpus_per_node": "0"}, "#SBATCH --exclusive")])
def test_sbatch_asks_for_cpus_requeues_and_uses_the_nproc_answer(bake, answers, cpus):
    script = (bake(**answers) / "slurm/train.sbatch").read_text()
    assert cpus in script  # Slurm's default, one CPU per task, starves the ranks and their loader workers
    assert "#SBATCH --requeue" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert f'NPROC_PER_NODE="${{NPROC_PER_NODE:-{answers.get("nproc_per_node", "auto")}}}"' in script


@pytest.mark.parametrize("gpus", ["8", "0"])
def test_sbatch_requests_one_torchrun_per_node(bake, gpus):
    project = bake(nnodes="1:3", gpus_per_node=gpus)
    script = (project / "slurm/train.sbatch").read_text()
    assert "#SBATCH --nodes=3" in script and "#SBATCH --ntasks-per-node=1" in script
    assert ("#SBATCH --gpus-per-node=8" in script) == (gpus == "8")
    assert "#SBATCH --signal=TERM@120" in script
    assert 'export RDZV_ID="$SLURM_JOB_ID"' in script
    shellcheck = run(["shellcheck", "slurm/train.sbatch"], cwd=project)
    assert shellcheck.returncode == 0, shellcheck.stdout


pytestmark = pytest.mark.xdist_group("slurm")  # under xdist: one test cluster (fixed ports), on one worker

HAS_SLURM = all(shutil.which(tool) for tool in ("munged", "slurmctld", "slurmd", "sbatch"))


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm (Debian's slurm-wlm), daemons started by hand; yields the environment to use it."""
    root = tmp_path_factory.mktemp("slurm")
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    (root / "slurm.conf").write_text(f"""\
ClusterName=ddptemplate
SlurmctldHost={host}
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# CPUs only: by default a job also takes all of the node's memory, so a second job waits however few CPUs it asks
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    environment = tool_env(SLURM_CONF=str(root / "slurm.conf"))
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)
    subprocess.run(["slurmctld", "-i"], env=environment, check=True)
    subprocess.run(["slurmd"], env=environment, check=True)
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=environment, capture_output=True,
                                           text=True).stdout:
            assert time.monotonic() < deadline, (root / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield environment
    finally:
        subprocess.run(["scontrol", "shutdown"], env=environment, capture_output=True)


@pytest.mark.slow
@require(os.geteuid() == 0 and HAS_SLURM, "needs root and Debian's slurm-wlm and munge")
def test_two_one_node_slurm_jobs_on_one_machine_train_side_by_side(bake, slurm_cluster, tmp_path):
    # 2 ranks a job: the script asks for 6 CPUs, and --cpus-per-task=1 lets both jobs onto this 2-CPU machine at
    # once (with gpus_per_node=0 and nproc_per_node=auto it asks for the whole machine, so they would queue).
    project = bake(gpus_per_node="0", nproc_per_node="2")
    jobs = {}
    for name in ("first", "second"):  # both at once: before, the second stopped with "port 29400 is taken"
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--cpus-per-task=1", "--no-requeue", "slurm/train.sbatch", "--model", "small_cnn",
             "--data", "fake", "--fake-samples", "256", "--image-size", "16", "--batch-size", "16",
             "--num-workers", "0", "--device", "cpu", "--max-steps", "4", "--ckpt-every", "2",
             "--ckpt-dir", str(tmp_path / name)],
            cwd=project, env=slurm_cluster, capture_output=True, text=True)
        assert submitted.returncode == 0, submitted.stderr
        jobs[submitted.stdout.strip().split(";")[0]] = tmp_path / name
    states = []
    for job_id, ckpt_dir in jobs.items():
        # Polled here: `sbatch --wait` polls at growing intervals, capped at 10 s, so it can return 10 s late.
        deadline = time.monotonic() + 300
        while (state := job_state(job_id, slurm_cluster))["JobState"] in ("PENDING", "RUNNING", "COMPLETING"):
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        output = (project / f"slurm-{job_id}.out").read_text()
        assert state["JobState"] == "COMPLETED", output
        assert "world_size=2 nodes=1 ranks_per_node=2" in output
        assert sorted(path.name for path in ckpt_dir.glob("step-*.pt")) == ["step-2.pt", "step-4.pt"]
        states.append(state)
    # Side by side: the second started before the first ended (whole seconds, ISO 8601: comparable as text).
    assert max(state["StartTime"] for state in states) < min(state["EndTime"] for state in states), states


def job_state(job_id: str, environment: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=environment, capture_output=True,
                           text=True, check=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


@pytest.mark.slow
@require(os.geteuid() == 0 and HAS_SLURM, "needs root and Debian's slurm-wlm and munge")
def test_a_slurm_job_sent_sigterm_saves_requeues_itself_and_resumes_bitwise(
        bake, slurm_cluster, uninterrupted_bare, tmp_path):
    # What preemption or the time limit does (--signal=TERM@120): SIGTERM to every process of the job step,
    # DataLoader workers included.
    project = bake(gpus_per_node="0")
    environment = {**slurm_cluster, "NPROC_PER_NODE": "2"}
    submitted = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=2", "slurm/train.sbatch", *BARE,
                                "--ckpt-dir", str(tmp_path)], cwd=project, env=environment,
                               capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = project / f"slurm-{job_id}.out"
    deadline = time.monotonic() + 180
    while not (tmp_path / "step-8.pt").exists():
        assert time.monotonic() < deadline, log.read_text() if log.exists() else job_state(job_id, environment)
        time.sleep(0.2)
    # Held still while the signal is sent, so that this small model's run cannot end first.
    job_processes = subprocess.run(["pgrep", "-f", f"--ckpt-dir {tmp_path}"], capture_output=True, text=True)
    with stopped([int(pid) for pid in job_processes.stdout.split()]):
        subprocess.run(["scancel", "--signal=TERM", job_id], env=environment, check=True)
    ended_at = pending_since = None  # a job that requeues itself passes through FAILED for a moment
    while (state := job_state(job_id, environment))["JobState"] != "COMPLETED":
        if state["JobState"] in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"):
            ended_at = None
        else:
            ended_at = ended_at or time.monotonic()
            assert time.monotonic() - ended_at < 10, (state, log.read_text())
        pending_since = (pending_since or time.monotonic()) if state["JobState"] == "PENDING" else None
        if state.get("Reason") == "BeginTime" and pending_since and time.monotonic() - pending_since > 12:
            # A requeued job waits out the old credential (cred_expire, 10 s here, 120 s by default) and then
            # the next scheduling pass (up to a minute): start it as soon as it may start.
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=environment, check=True)
            pending_since = None
        assert time.monotonic() < deadline + 180, log.read_text()
        time.sleep(0.5)
    output = log.read_text()  # --open-mode=append: both runs of the job
    assert state["Restarts"] == "1", output
    assert "stopped by SIGTERM after step" in output and "requeueing job" in output, output
    assert "resuming from" in output, output
    assert_bitwise_equal(checkpoint(tmp_path, 40), checkpoint(uninterrupted_bare, 40))


@pytest.mark.slow
@require(os.geteuid() == 0 and HAS_SLURM, "needs root and Debian's slurm-wlm and munge")
def test_a_slurm_job_with_a_usage_error_fails_once_and_is_not_requeued(bake, slurm_cluster, tmp_path):
    project = bake(gpus_per_node="0", nproc_per_node="2")
    submitted = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", "slurm/train.sbatch", "--model", "nope",
                                "--device", "cpu", "--ckpt-dir", str(tmp_path)],  # torchrun's retries: another test
                               cwd=project, env={**slurm_cluster, "MAX_RESTARTS": "0"}, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 180
    while (state := job_state(job_id, slurm_cluster))["JobState"] in ("PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    output = (project / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", (state, output)
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "--model 'nope' is not in the task's models" in ours[0], output
    assert f"train.sbatch: not requeueing job {job_id}: {ours[0]}" in output, output
