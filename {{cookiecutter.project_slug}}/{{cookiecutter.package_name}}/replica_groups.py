"""Replica groups on torchft (--replica-groups N): a lost machine costs the others about a second, not a restart.

Each machine is a replica group: a torchrun of its own, whose ranks train with DDP as in the default mode. Across
groups a torchft Manager averages each gradient bucket over the groups present at that step, and a Lighthouse
(run_node.sh starts one, or TORCHFT_LIGHTHOUSE names yours) forms a quorum before every step. When a group dies
the others drop the step in flight (at most one) and go on without it; torchrun restarts the dead group, which
copies a running group's whole state over the network (heals) and joins at its step. See docs/replica-groups.md.

What it gives up, said at start-up too: while a group is away the global batch is smaller and that group's
samples for those steps are not trained on, so a run is not bitwise equal to an uninterrupted one. The data is
split as if every group were present (a nominal world of N x the group's ranks), so a group's share of each
epoch is the same whether or not the others are there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .engine.checkpoint import Checkpointer
from .engine.distributed import DistEnv, StoreAddress, address_toward
from .engine.errors import UsageError
from .engine.replicas import bit_sum
from .engine.reproducibility import seed_per_rank
from .engine.task_state import PerRank

log = logging.getLogger(__name__)

MAX_DROPPED = 10
START_TIMEOUT = 600  # seconds a starting job waits for all its groups, as torchrun's rendezvous does
HEARTBEAT = timedelta(milliseconds=100)  # the Manager's beat to the Lighthouse (its --heartbeat_timeout_ms: 1000)


class ReplicaGroups:
    """This group's place among the replica groups, and the torchft Manager that keeps them one model."""

    def __init__(self, count: int, env: DistEnv, environ=os.environ):
        if not env.launched_by_torchrun:
            raise UsageError("--replica-groups needs torchrun, one per machine: use run_node.sh with REPLICA_GROUPS")
        if "TORCHFT_LIGHTHOUSE" not in environ:
            raise UsageError("--replica-groups needs TORCHFT_LIGHTHOUSE=http://host:port (run_node.sh sets it)")
        self.count, self.env = count, env
        self.id = int(environ.get("REPLICA_GROUP_ID", "0"))
        if not 0 <= self.id < count:
            raise UsageError(f"REPLICA_GROUP_ID={self.id}: with --replica-groups {count} it must be 0..{count - 1}")
        self.lighthouse = environ["TORCHFT_LIGHTHOUSE"]
        # Where the others reach this group (its Manager, and the state a healing group fetches): the address
        # run_node.sh found toward the Lighthouse's machine. torchft would advertise this machine's hostname,
        # which may resolve to another network there, or not at all (Debian maps its own to 127.0.1.1; a
        # cluster's to Ethernet instead of InfiniBand, meta-pytorch/torchft#329).
        self.address = environ.get("REPLICA_GROUP_ADDR") or address_toward(
            self.lighthouse.split("://")[-1].rsplit(":", 1)[0].strip("[]"))
        self.healed = False  # by the last quorum
        self.pending = False  # a quorum taken for the next step already
        self.quorum = None  # the quorum of the last step: a new one checks that every group holds one model
        self.committing = (-1, False)  # (step, whether it commits)

    def join(self, device: torch.device, store: StoreAddress, step_timeout: float, io_timeout: float) -> None:
        """Start this group's Manager, which meets the Lighthouse (its ranks meet in this attempt's store).

        A collective across groups gives up on a lost peer after 3/4 of --step-timeout (NCCL may only notice one
        then), before the watchdog would end the survivors; a quorum waits as long as a slow phase may take (a
        group's evaluation or save holds the others at the next quorum)."""
        timeout = timedelta(seconds=0.75 * step_timeout)
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        advertised = self.address  # where torchft would name socket.gethostname(): the state a healing group
        # fetches, and the store on which the groups' process group is made

        class AdvertisedTransport(HTTPTransport):
            def address(self) -> str:
                return f"http://{advertised}:{self._server.socket.getsockname()[1]}/checkpoint/"

        def advertising(kind: type) -> type:
            class Advertised(kind):
                def get_reconfigure_handle(self) -> str:
                    if self._rendezvous_store is None:  # torchft's own connects to gethostname()
                        self._rendezvous_store = torch.distributed.TCPStore(advertised, 0, is_master=True,
                                                                            wait_for_workers=False)
                    handle = json.loads(super().get_reconfigure_handle())
                    handle["store"] = f"{advertised}:{handle['store'].rsplit(':', 1)[1]}"
                    return json.dumps(handle)
            return Advertised

        self.device = device
        for name in ("torchft", "torchft_quorums", "torchft_commits"):  # a line per step otherwise
            logging.getLogger(name).setLevel(logging.WARNING)
        across = advertising(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
        self.manager = Manager(
            pg=across, load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=io_timeout), connect_timeout=timedelta(seconds=60),
            max_retries=MAX_DROPPED,  # steps dropped in a row: then this group fails, restarts and heals
            rank=self.env.rank, world_size=self.env.world_size, store_addr=store.host, store_port=store.port,
            lighthouse_addr=self.lighthouse, replica_id=f"group{self.id}", hostname=self.address,
            init_sync=False,  # step 0: every group built the same model from --seed (and checks it: below)
            heartbeat_interval=HEARTBEAT, checkpoint_transport=AdvertisedTransport(timeout=timeout, num_chunks=0))

    def data_env(self) -> DistEnv:
        """The data's view of this rank: rank group x ranks + rank of N x ranks, as if every group were present."""
        return dataclasses.replace(self.env, rank=self.id * self.env.world_size + self.env.rank,
                                   world_size=self.count * self.env.world_size)

    def checkpoint_dir(self, ckpt_dir: str) -> str:
        """Each group writes its own checkpoints (one folder each, on shared storage or not)."""
        return os.path.join(ckpt_dir, f"replica-group-{self.id}")

    def average_gradients(self, networks: SimpleNamespace) -> None:
        """DDP all-reduces each bucket within the group, then the Manager averages it over the groups present
        (a group of one rank is wrapped in DDP too, for its buckets). A lost peer fails the Manager's all-reduce:
        the bucket keeps the group's mean, and the step is not committed anywhere (should_commit)."""
        ddp = networks.model
        if not isinstance(ddp, DistributedDataParallel):
            ddp = networks.model = DistributedDataParallel(ddp, find_unused_parameters=True)
        self.model = ddp.module  # the model itself: what the checks and the buffer average read
        if not ddp.find_unused_parameters:
            # DDP rebuilds its buckets after the first step unless find_unused_parameters: a group that joins
            # later would average its first step's layout against the others' rebuilt one, one parameter's
            # gradient against another's.
            raise UsageError("--replica-groups needs DDP built with find_unused_parameters=True")
        from torchft.manager import _ManagedFuture

        group_size, manager = self.env.world_size, self.manager

        def hook(state, bucket):  # no annotations: DDP checks them, and here they would be strings
            buffer = bucket.buffer()
            torch.distributed.all_reduce(buffer)  # this group's ranks
            buffer /= group_size
            work = manager.allreduce(buffer)  # the mean over the groups of this step's quorum
            if not work.wait():
                done = torch.futures.Future()
                done.set_result(buffer)
                return done
            future = work.get_future()
            return future._fut if isinstance(future, _ManagedFuture) else future

        ddp.register_comm_hook(None, hook)

    def share(self, checkpointer: Checkpointer, progress: Any, seed: int) -> None:
        """What a healing group copies from a running one: what a checkpoint holds (every component and the
        loop's progress), all but the random generators: each rank reseeds its own from --seed, its place in the
        nominal world and the step, so that two groups never draw the same dropout masks."""
        if per_rank := [name for name, component in checkpointer.components.items() if isinstance(component, PerRank)]:
            raise UsageError(f"--replica-groups heals a group with another group's state, but the task state "
                             f"{per_rank[0]!r} is per rank (each rank's own, of its own data): train without "
                             "--replica-groups, or keep that state the same on every rank")

        def state_dict() -> dict:
            return {"components": {name: component.state_dict() for name, component in checkpointer.components.items()
                                   if name != "replica_groups"}, "progress": asdict(progress)}

        def load_state_dict(state: dict) -> None:
            for name, component_state in state["components"].items():
                checkpointer.components[name].load_state_dict(component_state)
            vars(progress).update(state["progress"])
            seed_per_rank(seed + progress.step, self.data_env(), self.device, rank_0_too=True)
            self.healed = True
            log.info("healed from another replica group: step %d, epoch %d", progress.step, progress.epoch)

        self.manager.register_state_dict_fn("training", load_state_dict, state_dict)

    def wait_for_the_others(self) -> None:
        """At a job's start (not a group's restart by its torchrun, which joins the running groups): quorums
        until another group is in one (every group, of one), for at most START_TIMEOUT seconds, lest the first
        group up train alone. That quorum is the first step's: the others present may be training already,
        inside it. A group behind them heals here, before its loader starts."""
        if self.env.restart_count:
            return
        deadline = time.monotonic() + START_TIMEOUT
        self.manager.start_quorum()
        while self.manager.num_participants() < min(2, self.count):
            if time.monotonic() > deadline:
                log.warning("no other replica group came within %d s; training alone until one does", START_TIMEOUT)
                break
            time.sleep(0.5)
            self.manager.start_quorum()
        self.pending = True

    def start_step(self, progress: Any, check_every: int) -> bool:
        """This step's quorum, which heals this group if it is behind. True if it healed: the loop then starts
        again from the progress it brought (its data position) and calls again, which joins the same step.

        The groups' models are compared when the quorum changed (a group came or went: every group present sees
        the same new one) and every `check_every` steps: conditions alike on every group, since each comparison is
        a collective across them, as is each step's gradient all-reduce that follows."""
        if self.pending:  # the quorum of the start's wait, or the one that healed us: this step's
            self.pending = False
        else:
            self.healed = False
            self.manager.start_quorum()
            if self.healed:
                self.pending = True
                return True
        quorum = self.manager._quorum_id  # torchft has no public name for it (pinned version)
        if quorum != self.quorum or progress.step % check_every == 0:
            if quorum != self.quorum:
                log.info("step %d: %d of %d replica groups train", progress.step + 1,
                         self.manager.num_participants(), self.count)
            self.quorum = quorum
            self.check_replicas_match(progress.step)
        return False

    def average_buffers(self) -> None:
        """The groups' buffers (BatchNorm's running statistics) averaged after every step's forward: gradients
        keep the parameters one model, but each group's buffers follow its own batches, and evaluations and
        checkpoints would differ between groups. (Within a group, DDP gives every rank rank 0's at each forward,
        and a save takes rank 0's.) A failed all-reduce leaves them as they were."""
        for dtype in dict.fromkeys(buffer.dtype for buffer in self.model.buffers()):  # one order on every group
            buffers = [buffer for buffer in self.model.buffers() if buffer.dtype == dtype]
            flat = torch.cat([buffer.detach().flatten() for buffer in buffers])
            op = torch.distributed.ReduceOp.AVG if dtype.is_floating_point else torch.distributed.ReduceOp.MAX
            if not self.manager.allreduce(flat, reduce_op=op).wait():
                return
            with torch.no_grad():
                for buffer, value in zip(buffers, flat.split([buffer.numel() for buffer in buffers]), strict=True):
                    buffer.copy_(value.view_as(buffer))

    def should_commit(self, step: int, allowed: bool) -> bool:
        """Whether every rank of this group, and the cross-group all-reduces, finished step `step`: else no
        optimizer steps (the step is dropped here; a group that did commit it is healed from later). Asked once
        per step, whatever the number of optimizers updated. `allowed`: this group's verdict on a non-finite
        loss; a group that skips the update drops the step, and heals from the others if they took it."""
        if self.committing[0] != step:
            if not allowed:
                self.manager.report_error(RuntimeError(f"step {step} skipped: not finite"))
            self.average_buffers()  # as this step's forward left them
            self.committing = (step, self.manager.should_commit())
            if not self.committing[1] and allowed:
                log.warning("step %d dropped: a replica group was lost during it, and its update was not applied "
                            "here", step)
        return self.committing[1]

    def check_replicas_match(self, step: int) -> None:
        """Stop unless every group present holds the same parameters, and has as many ranks and groups as this
        one (one small all-reduce, like each group's own check in engine/replicas.py): a heal or a gradient
        averaged over others than its peers' would train several models under one loss curve, and groups of
        other sizes would split the data differently, training some samples twice and others never."""
        shape = torch.tensor([self.env.world_size, self.count])
        sums = torch.cat([shape, torch.stack([bit_sum(parameter).cpu() for parameter in self.model.parameters()])])
        extremes = torch.cat([sums, -sums]).to(self.device)
        if not self.manager.allreduce(extremes, reduce_op=torch.distributed.ReduceOp.MAX).wait():
            self.quorum = None  # a group was lost: this step is dropped anyway, and checked at the next quorum
            return
        largest, smallest = extremes[:len(sums)].cpu(), -extremes[len(sums):].cpu()
        if not torch.equal(largest[:2], smallest[:2]):
            raise UsageError(f"the replica groups differ in size: {smallest[0]}-{largest[0]} ranks, "
                             f"--replica-groups {smallest[1]}-{largest[1]}; give every machine the same "
                             "NPROC_PER_NODE and REPLICA_GROUPS")
        if not torch.equal(largest, smallest):
            raise UsageError(f"the replica groups hold different models at step {step} "
                             f"({self.manager.num_participants()} groups present): " + (
                                 "give every machine the same command and code (--seed, --model, task.py)"
                                 if step == 0 else "stopping; resume from the newest checkpoints"))

    def checkpoint_entries(self) -> dict:
        """torchft's own step count, saved with the rest: a job whose every group was lost resumes at it."""
        return {"replica_groups": self.manager}

    def describe(self) -> str:
        return (f"replica group {self.id} of {self.count} (torchft): a lost group costs the others about a second "
                f"and at most one step; while a group is away the batch is smaller and its samples for those steps "
                f"are not trained on, so the run is not bitwise equal to an uninterrupted one; a healing group fetches "
                f"this one's state from {self.manager._checkpoint_transport.metadata()}")

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
