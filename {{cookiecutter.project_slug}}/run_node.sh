#!/usr/bin/env bash
# Start this machine's share of a training job. Run the SAME command on every machine of the job;
# torchrun's c10d rendezvous on RDZV_ENDPOINT groups them, numbers the ranks, and restarts the group on
# failure. Arguments after the script go to train.py.
#
#   ./run_node.sh --epochs 5                                        # one machine, all its devices
#   NNODES=2 RDZV_ENDPOINT=node0:{{ cookiecutter.rdzv_port }} ./run_node.sh --epochs 5       # on node0 AND on node1
#
# Environment (defaults were chosen when the project was generated):
#   NNODES          machines in the job, or MIN:MAX for an elastic job   (default {{ cookiecutter.nnodes }})
#   NPROC_PER_NODE  processes per machine: auto, gpu, cpu or a number    (default {{ cookiecutter.nproc_per_node }})
#   RDZV_ENDPOINT   host[:port] of one machine of the job, the same for all (port default {{ cookiecutter.rdzv_port }})
#   RDZV_ID         job id, the same on all machines; another id makes another job (default $SLURM_JOB_ID or {{ cookiecutter.project_slug }})
#   MAX_RESTARTS    times torchrun restarts the worker group after a failure (default {{ cookiecutter.max_restarts }})
set -euo pipefail

NNODES="${NNODES:-{{ cookiecutter.nnodes }}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-{{ cookiecutter.nproc_per_node }}}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-{{ cookiecutter.project_slug }}}}"
MAX_RESTARTS="${MAX_RESTARTS:-{{ cookiecutter.max_restarts }}}"
DEFAULT_RDZV_PORT="{{ cookiecutter.rdzv_port }}"

fail() {
  echo "run_node.sh: error: $*" >&2
  exit 2
}

[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || fail "NNODES='$NNODES' must be a number of machines (2) or MIN:MAX (1:4)"
[[ "$NPROC_PER_NODE" =~ ^(auto|gpu|cpu|[1-9][0-9]*)$ ]] || fail "NPROC_PER_NODE='$NPROC_PER_NODE' must be auto, gpu, cpu or a number"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || fail "MAX_RESTARTS='$MAX_RESTARTS' must be a whole number"
MAX_NODES="${NNODES#*:}"

# torchrun >= 2.5 shares its rendezvous TCPStore with the workers and keeps it across restarts, so a
# restarted worker can read its dead predecessor's process-group keys and hang or fail to connect
# (pytorch/pytorch#135712). A fresh store per restart avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

cd "$(dirname "${BASH_SOURCE[0]}")"

if [[ -z "$RDZV_ENDPOINT" ]]; then
  if [[ "$MAX_NODES" != 1 ]]; then
    fail "NNODES=$NNODES needs RDZV_ENDPOINT=host:port, the same on every machine (e.g. RDZV_ENDPOINT=node0:$DEFAULT_RDZV_PORT)"
  fi
  # One machine: torchrun runs its own rendezvous on a free local port.
  exec torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" train.py "$@"
fi

if [[ "$RDZV_ENDPOINT" != *:* ]]; then
  RDZV_ENDPOINT="$RDZV_ENDPOINT:$DEFAULT_RDZV_PORT"
fi
echo "run_node.sh: nnodes=$NNODES nproc_per_node=$NPROC_PER_NODE rdzv_endpoint=$RDZV_ENDPOINT rdzv_id=$RDZV_ID max_restarts=$MAX_RESTARTS" >&2
exec torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" \
  --max-restarts="$MAX_RESTARTS" train.py "$@"
