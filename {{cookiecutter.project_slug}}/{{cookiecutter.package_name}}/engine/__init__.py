"""The engine: what every run uses and almost nobody needs to read. Its modules import one another and torch,
never the package around them (task.py, train.py, options.py, ...), which import it.

What it guarantees, whatever the task:
- joining the job (distributed.py): torchrun's environment read once, a device per LOCAL_RANK, a fresh store
  per torchrun attempt, the process group and a gloo side group; the job's sockets kept from loader workers
  (processes.py);
- a rank that stops making progress is named, with where every rank was, and ended so torchrun restarts the
  group; SIGTERM saves and stops every rank after the same step (watchdog.py); a failed attempt says why in
  one line, and a bug is not retrained on every restart (failure.py);
- checkpoints (checkpoint/) written whole or not at all, resumed from the newest valid one at any world
  size, with every rank's random generators (reproducibility.py) and the options they were trained with;
  the replicas checked to hold one model (replicas.py){% if cookiecutter.use_streaming == "yes" %}; a stream's position (streaming.py){% endif %};
- the run as planned: flags and --config files (cli.py), each epoch's samples in an order that any
  world size resumes (data.py), DDP or FSDP2 (parallel.py), precision, a non-finite step caught on every rank,
  a loss that bypasses the wrapped model refused, the lr schedule over samples seen (optim.py), held-out sums
  exact across ranks (evaluation.py), what is logged (metrics.py{% if cookiecutter.use_trackers == "yes" %}, trackers.py{% endif %}), the best
  checkpoint (selection.py);
- the task's spec honoured (tasks.py): names checked, state saved per rank or checked alike on every rank
  (task_state.py), work rank 0 does alone changing no draw of the run.

Names a task may call: `errors.UsageError` (refuse bad input in one line), `collectives` (all_reduce and
friends, which also work in one plain process), `task_state.PerRank` and `task_state.leave_out_of_checkpoints`,
`checkpoint.weights.load_checkpoint` (a checkpoint's weights and options in one process), `tasks.build_model`,
and `checkpoint.build_checkpointer`'s components (add state to it in train.py){% if cookiecutter.use_streaming == "yes" %}, and `streaming`'s readers
for a task's streamed datasets{% endif %}."""
