#!/usr/bin/env python3
r"""Train an image classifier with DistributedDataParallel, launched by torchrun.

    python train.py --max-steps 50                        # one plain process, for debugging
    ./run_node.sh --epochs 5                              # all GPUs (or CPU ranks) of this machine
    NNODES=2 RDZV_ENDPOINT=node0:{{ cookiecutter.rdzv_port }} ./run_node.sh --epochs 5   # same on each machine
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # by hand: restarts can hang without it (run_node.sh sets it)
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=node0:{{ cookiecutter.rdzv_port }} --rdzv-id=job1 train.py --epochs 5

Every flag: `python train.py --help`. Restarted by torchrun, a scheduler or you, training resumes from the
newest checkpoint in --ckpt-dir. The loop below is yours to edit; torchrun details live in
{{ cookiecutter.package_name }}/distributed.py.
"""

import sys

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from {{ cookiecutter.package_name }}.checkpoint import Checkpointer, check_checkpoint_dir
from {{ cookiecutter.package_name }}.data import build_datasets, build_loaders, check_data_source
from {{ cookiecutter.package_name }}.distributed import (
    EXIT_CODE_AFTER_SIGTERM,
    DistEnv,
    StopRequest,
    distributed_session,
    select_device,
    wrap_model,
)
from {{ cookiecutter.package_name }}.errors import UsageError
from {{ cookiecutter.package_name }}.evaluation import evaluate
from {{ cookiecutter.package_name }}.model import build_model, check_model_name
from {{ cookiecutter.package_name }}.options import TrainOptions, parse_options
from {{ cookiecutter.package_name }}.reporting import (
    TrainingMeter,
    describe_job,
    log,
    setup_logging,
    warn_about_launch_pitfalls,
)


def train(options: TrainOptions, env: DistEnv, device: torch.device) -> None:
    log.info("%s", describe_job(env, device))
    warn_about_launch_pitfalls(env)
    stop_request = StopRequest(device)  # from here on, SIGTERM means "save and stop at the next step"
    torch.manual_seed(options.seed)
    train_set, eval_set = build_datasets(options, env, device)
    train_loader, eval_loader = build_loaders(train_set, eval_set, options, env, device)
    model = build_model(options.model, options.num_classes).to(device)
    ddp_model = wrap_model(model, device)  # forward/backward through ddp_model; save and evaluate `model`
    optimizer = torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9, weight_decay=5e-4)
    checkpointer = Checkpointer(options.ckpt_dir, options.keep_checkpoints, env, device)
    progress = checkpointer.resume(model, optimizer)
    global_batch_size = options.batch_size * env.world_size
    meter = TrainingMeter(device)

    while not progress.finished(options.epochs, options.max_steps):
        # Mid-epoch resume: skip exactly the samples this epoch has already trained on.
        train_loader.sampler.set_epoch(progress.epoch, start_sample=progress.samples_in_epoch)
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp_model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces gradients here, overlapped with the backward pass
            optimizer.step()
            progress.advance(global_batch_size)
            meter.update(loss, global_batch_size)
            if progress.step % options.log_every == 0:
                meter.log_and_reset(progress.step, progress.epoch, optimizer.param_groups[0]["lr"])
            if progress.step % options.ckpt_every == 0:
                checkpointer.save(model, optimizer, progress)
            if stop_request.agreed():  # SIGTERM reached some rank: preemption, or torchrun shutting down
                checkpointer.save(model, optimizer, progress)
                log.info("stopped by SIGTERM after step %d; run the same command again to resume", progress.step)
                sys.exit(EXIT_CODE_AFTER_SIGTERM)
            if progress.finished(options.epochs, options.max_steps):
                break
        else:  # the epoch ran to its end
            progress.next_epoch()
            log.info("epoch %d done | eval loss %.4f | accuracy %.3f on %d held-out samples",
                     progress.epoch, *evaluate(model, eval_loader, device))

    if progress.samples_in_epoch:  # stopped by --max-steps part-way through an epoch
        log.info("stopped at step %d | eval loss %.4f | accuracy %.3f on %d held-out samples",
                 progress.step, *evaluate(model, eval_loader, device))
    checkpointer.save(model, optimizer, progress)


@record  # an uncaught exception's traceback reaches torchrun's failure summary
def main(argv: list[str] | None = None) -> None:
    try:
        env = DistEnv.from_environ()
        setup_logging(env)
        options = parse_options(argv)
        device = select_device(options.device, env)
        # Bad input fails here, on every rank, before any process group or download starts.
        check_model_name(options.model)
        check_data_source(options)
        check_checkpoint_dir(options.ckpt_dir)
        with distributed_session(env, device):
            train(options, env, device)
    except UsageError as error:
        sys.stderr.write(f"error: {error}\n")  # one write, so lines from several ranks do not interleave
        sys.exit(1)


if __name__ == "__main__":
    main()
