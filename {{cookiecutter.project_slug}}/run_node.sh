#!/usr/bin/env bash
# Start this machine's share of a training job. Run the SAME command on every machine of the job;
# torchrun's c10d rendezvous on RDZV_ENDPOINT groups them, numbers the ranks, and restarts the group on
# failure. Arguments after the script go to train.py.
#
{%- if cookiecutter.use_preflight == "yes" %}
#   ./run_node.sh --preflight                                       # check ranks, devices, network first
#
{%- endif %}
#   ./run_node.sh --epochs 5                                        # one machine, all its devices
#   NNODES=2 RDZV_ENDPOINT=node0:{{ cookiecutter.rdzv_port }} ./run_node.sh --epochs 5       # on node0 AND on node1
#
# Environment (defaults were chosen when the project was generated):
#   NNODES          machines in the job, or MIN:MAX for an elastic job   (default {{ cookiecutter.nnodes }})
#   NPROC_PER_NODE  processes per machine: auto, gpu, cpu or a number    (default {{ cookiecutter.nproc_per_node }})
#   RDZV_ENDPOINT   host[:port] of one machine of the job, the same for all (port default {{ cookiecutter.rdzv_port }})
#   RDZV_ID         job id, the same on all machines; another id makes another job (default $SLURM_JOB_ID or {{ cookiecutter.project_slug }})
#   MAX_RESTARTS    times torchrun restarts the worker group after a failure (default {{ cookiecutter.max_restarts }})
#   RDZV_TIMEOUT    seconds to wait for all machines to join before giving up (default 900)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun gives workers to save after SIGTERM (default 100)
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE  1 (default with RDZV_ENDPOINT; unset on one machine): machines may join a running elastic job
#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME   network interface for gloo / NCCL (default: the one toward
#                   RDZV_ENDPOINT, found with `ip route get`)
{%- if cookiecutter.fault_tolerance == "torchft" %}
#   REPLICA_GROUPS  torchft (docs/replica-groups.md): this many replica groups, a machine each, with a torchrun of
#                   its own that restarts only this machine; unset or 0: one torchrun over every machine (default)
#   REPLICA_GROUP_ID  this machine's group, 0..REPLICA_GROUPS-1 (default $SLURM_NODEID or 0)
#   TORCHFT_LIGHTHOUSE  http://host:port of a Lighthouse you run (./run_node.sh --lighthouse); default: group 0
#                   starts one on RDZV_ENDPOINT (localhost:{{ cookiecutter.rdzv_port }} on one machine), where the others find it
{%- endif %}
set -euo pipefail

NNODES="${NNODES:-{{ cookiecutter.nnodes }}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-{{ cookiecutter.nproc_per_node }}}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-{{ cookiecutter.project_slug }}}}"
MAX_RESTARTS="${MAX_RESTARTS:-{{ cookiecutter.max_restarts }}}"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-900}"
DEFAULT_RDZV_PORT="{{ cookiecutter.rdzv_port }}"

fail() {
  echo "run_node.sh: error: $*" >&2
  exit 2
}

# This machine's network address, where its hostname resolves to loopback here (Debian and Ubuntu map it to
# 127.0.1.1): the one on GLOO_SOCKET_IFNAME, the default route's interface, or the only interface with a global
# address; nothing when that is unclear.
own_network_address() {
  local interface
  interface="${GLOO_SOCKET_IFNAME:-$(ip -o route show default | awk 'NR == 1 { for (i = 1; i < NF; i++) if ($i == "dev") print $(i + 1) }')}"
  if [[ -z "$interface" ]] && (($(ip -o -4 addr show scope global | wc -l) == 1)); then
    interface="$(ip -o -4 addr show scope global | awk '{ print $2 }')"
  fi
  ip -o -4 addr show dev "${interface:-lo}" scope global 2>/dev/null | awk 'NR == 1 { split($4, a, "/"); print a[1] }'
}

[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || fail "NNODES='$NNODES' must be a number of machines (2) or MIN:MAX (1:4)"
[[ "$NPROC_PER_NODE" =~ ^(auto|gpu|cpu|[1-9][0-9]*)$ ]] || fail "NPROC_PER_NODE='$NPROC_PER_NODE' must be auto, gpu, cpu or a number"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || fail "MAX_RESTARTS='$MAX_RESTARTS' must be a whole number"
[[ "$RDZV_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || fail "RDZV_TIMEOUT='$RDZV_TIMEOUT' must be a number of seconds"
MAX_NODES="${NNODES#*:}"

# After forwarding SIGTERM (preemption, a time limit), torchrun waits this long for its workers to save and
# exit before SIGKILL; its own default, 30 s, cuts short a large checkpoint. Keep it below the grace the
# scheduler gives (slurm/train.sbatch: --signal=TERM@120; k8s: terminationGracePeriodSeconds 120).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}"
cd "$(dirname "${BASH_SOURCE[0]}")"

# torchrun as its console script runs it (torch.distributed.run's main), except that a stop by a signal (a
# preemption's SIGTERM, Ctrl-C) ends in one line and the shell's status for that signal (143 for SIGTERM, which
# schedulers retry), where torchrun prints a traceback of its own SignalException and exits 1.
TORCHRUN_SCRIPT="$(command -v torchrun)" || fail "torchrun is not on PATH: activate the environment PyTorch is installed in"
TORCHRUN_PYTHON="$(sed -n '1s/^#!\([^ ]*python[0-9.]*\)$/\1/p' "$TORCHRUN_SCRIPT")"  # the interpreter its script names
TORCHRUN=("${TORCHRUN_PYTHON:-python3}" -c 'import signal, sys
sys.path.pop(0)  # not this folder: torchrun itself imports nothing of the project
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
sys.argv[0] = "torchrun"
try:
    main()
except SignalException as stop:
    print(f"run_node.sh: torchrun stopped by {signal.Signals(stop.sigval).name}", file=sys.stderr)
    sys.exit(128 + stop.sigval)')
ENTRY_POINT=(train.py)
{%- if cookiecutter.use_preflight == "yes" %}
if [[ "${1:-}" == --preflight ]]; then
  shift
  ENTRY_POINT=(-m {{ cookiecutter.package_name }}.preflight)
fi
{%- endif %}

{%- if cookiecutter.fault_tolerance == "torchft" %}
REPLICA_GROUPS="${REPLICA_GROUPS:-0}"
[[ "$REPLICA_GROUPS" =~ ^[0-9]+$ ]] || fail "REPLICA_GROUPS='$REPLICA_GROUPS' must be a number of replica groups (machines), or 0"
if [[ "${1:-}" == --lighthouse || "$REPLICA_GROUPS" != 0 ]]; then
  ENDPOINT="${RDZV_ENDPOINT:-localhost}"
  [[ "$ENDPOINT" == *:* ]] || ENDPOINT="$ENDPOINT:$DEFAULT_RDZV_PORT"
  # min_replicas 1: the groups left keep training; a group that stops heartbeating for 1 s is dropped, and one
  # that is starting (heartbeating) is waited for at most 2 s.
  LIGHTHOUSE=(torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 --heartbeat_timeout_ms 1000
    --bind "[::]:${ENDPOINT##*:}")
  # torchft's own log (the Lighthouse's and each Manager's): a few lines per step at info.
  export RUST_LOG="${RUST_LOG:-warn}"
  if [[ "${1:-}" == --lighthouse ]]; then
    exec "${LIGHTHOUSE[@]}"
  fi
  export REPLICA_GROUP_ID="${REPLICA_GROUP_ID:-${SLURM_NODEID:-0}}"
  if [[ ! "$REPLICA_GROUP_ID" =~ ^[0-9]+$ ]] || ((REPLICA_GROUP_ID >= REPLICA_GROUPS)); then
    fail "REPLICA_GROUP_ID='$REPLICA_GROUP_ID' must be 0..$((REPLICA_GROUPS - 1)), another on each machine"
  fi
  LIGHTHOUSE_PID=""
  if [[ -z "${TORCHFT_LIGHTHOUSE:-}" && "$REPLICA_GROUP_ID" == 0 ]]; then
    "${LIGHTHOUSE[@]}" &
    LIGHTHOUSE_PID=$!
    sleep 0.5
    kill -0 "$LIGHTHOUSE_PID" 2>/dev/null || fail "the Lighthouse did not start on port ${ENDPOINT##*:} (taken?); choose another in RDZV_ENDPOINT"
  fi
  export TORCHFT_LIGHTHOUSE="${TORCHFT_LIGHTHOUSE:-http://$ENDPOINT}"
  LIGHTHOUSE_HOST="${TORCHFT_LIGHTHOUSE#*://}"
  LIGHTHOUSE_HOST="${LIGHTHOUSE_HOST%:*}"
  LIGHTHOUSE_IP="$(getent ahostsv4 "$LIGHTHOUSE_HOST" | awk 'NR == 1 { print $1 }' || true)"
  [[ -n "$LIGHTHOUSE_IP" ]] || fail "the Lighthouse's host '$LIGHTHOUSE_HOST' does not resolve here"
  # Where the other groups reach this one (to heal, and to meet): our address on the route toward the
  # Lighthouse, not what the hostname resolves to (meta-pytorch/torchft#329). A Lighthouse on this machine under
  # a name that resolves to loopback here (Debian: 127.0.1.1) is reached from elsewhere on our network address.
  if [[ -z "${REPLICA_GROUP_ADDR:-}" ]]; then
    TOWARD="$LIGHTHOUSE_IP"
    if [[ "$LIGHTHOUSE_IP" == 127.* && "$LIGHTHOUSE_HOST" != 127.* && "$LIGHTHOUSE_HOST" != localhost ]]; then
      command -v ip >/dev/null || fail "the 'ip' command (iproute2) is needed to find this machine's address"
      TOWARD="$(own_network_address)"
      [[ -n "$TOWARD" ]] || fail "the Lighthouse's host '$LIGHTHOUSE_HOST' is this machine, whose network address is unclear: set GLOO_SOCKET_IFNAME or REPLICA_GROUP_ADDR"
    fi
    if [[ "$TOWARD" == 127.* ]]; then
      REPLICA_GROUP_ADDR=127.0.0.1  # every group on this machine
    else
      command -v ip >/dev/null || fail "the 'ip' command (iproute2) is needed to find this machine's address toward $LIGHTHOUSE_HOST"
      REPLICA_GROUP_ADDR="$(ip -o route get "$TOWARD" | awk '{ for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1) }')"
      [[ -n "$REPLICA_GROUP_ADDR" ]] || REPLICA_GROUP_ADDR="$TOWARD"  # a local route: the address itself
    fi
  fi
  export REPLICA_GROUP_ADDR
  echo "run_node.sh: replica group $REPLICA_GROUP_ID of $REPLICA_GROUPS nproc_per_node=$NPROC_PER_NODE lighthouse=$TORCHFT_LIGHTHOUSE address=$REPLICA_GROUP_ADDR max_restarts=$MAX_RESTARTS" >&2
  unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  TORCHRUN+=(--standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS"
    "${ENTRY_POINT[@]}" "$@")
  [[ "${ENTRY_POINT[0]}" != train.py ]] || TORCHRUN+=(--replica-groups "$REPLICA_GROUPS")
  if [[ -z "$LIGHTHOUSE_PID" ]]; then
    exec "${TORCHRUN[@]}"
  fi
  # torchrun beside the Lighthouse, which ends after it (the other groups may still be saving); SIGTERM
  # (preemption) is passed on to torchrun.
  TORCHRUN_PID=""
  trap 'kill -TERM $TORCHRUN_PID 2>/dev/null' TERM INT
  "${TORCHRUN[@]}" &
  TORCHRUN_PID=$!
  STATUS=0
  wait "$TORCHRUN_PID" || STATUS=$?
  if kill -0 "$TORCHRUN_PID" 2>/dev/null; then  # the wait was cut short by the signal
    STATUS=0
    wait "$TORCHRUN_PID" || STATUS=$?
  fi
  kill "$LIGHTHOUSE_PID" 2>/dev/null || true
  exit "$STATUS"
fi

{%- endif %}

if [[ -z "$RDZV_ENDPOINT" ]]; then
  if [[ "$MAX_NODES" != 1 ]]; then
    fail "NNODES=$NNODES needs RDZV_ENDPOINT=host:port, the same on every machine (e.g. RDZV_ENDPOINT=node0:$DEFAULT_RDZV_PORT)"
  fi
  # One machine: torchrun runs its own rendezvous on a free local port, and its workers share that store, also
  # if TORCH_DISABLE_SHARE_RDZV_TCP_STORE came from the environment (nothing can join a standalone job). Unshared,
  # torchrun would pick a free port for rank 0 to listen on seconds later, and another job on this machine could
  # take it in between (pytorch/pytorch#126510).
  unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  exec "${TORCHRUN[@]}" --standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" "${ENTRY_POINT[@]}" "$@"
fi

# torchrun (up to at least 2.14) shares its rendezvous store with the workers, and a machine that joins a
# running elastic job then waits 60 s for a worker-store address that the remaining rank-0 machine never
# publishes for the new round, and fails. Unshared, every round publishes it afresh. (train.py runs either
# way: it starts a fresh store for every attempt.)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

if [[ "$RDZV_ENDPOINT" != *:* ]]; then
  RDZV_ENDPOINT="$RDZV_ENDPOINT:$DEFAULT_RDZV_PORT"
fi
ENDPOINT_HOST="${RDZV_ENDPOINT%:*}"
ENDPOINT_PORT="${RDZV_ENDPOINT##*:}"
if [[ ! "$ENDPOINT_PORT" =~ ^[0-9]+$ ]] || (( ENDPOINT_PORT < 1 || ENDPOINT_PORT > 65535 )); then
  fail "RDZV_ENDPOINT='$RDZV_ENDPOINT' needs a port between 1 and 65535"
fi
ENDPOINT_IP="$(getent ahostsv4 "$ENDPOINT_HOST" | awk 'NR == 1 { print $1 }' || true)"
[[ -n "$ENDPOINT_IP" ]] || fail "RDZV_ENDPOINT host '$ENDPOINT_HOST' does not resolve here; use its IP address or a name every machine resolves"

# torchrun guesses from this machine's hostname whether it hosts the rendezvous store and what address
# the others should use. In containers and on hosts with several networks the hostname often resolves
# elsewhere: then no machine hosts the store (a hang) or MASTER_ADDR is unreachable. So decide here, from
# the route toward the endpoint: its source address is ours, and a "local" route means we are the endpoint.
RDZV_CONF="join_timeout=$RDZV_TIMEOUT"
LOCAL_ADDR_ARGS=()
DETECTED="address detection skipped (loopback endpoint: all nodes on this machine)"
ROUTE_TARGET="$ENDPOINT_IP"
if [[ "$ENDPOINT_IP" == 127.* && "$ENDPOINT_HOST" != 127.* && "$ENDPOINT_HOST" != localhost ]]; then
  # A name that resolves to loopback here is this machine's own: this machine is the endpoint, and the others
  # reach it on its network address.
  command -v ip >/dev/null || fail "the 'ip' command (iproute2) is needed to find this machine's network address"
  OWN_ADDR="$(own_network_address)"
  if [[ -n "$OWN_ADDR" ]]; then
    ROUTE_TARGET="$OWN_ADDR"
  elif [[ "$MAX_NODES" != 1 ]]; then
    fail "RDZV_ENDPOINT host '$ENDPOINT_HOST' is this machine, but resolves to $ENDPOINT_IP here, which the other machines cannot reach, and this machine's network address is unclear: set GLOO_SOCKET_IFNAME to the interface they reach it on, or put its address in RDZV_ENDPOINT"
  fi
fi
if [[ "$ROUTE_TARGET" != 127.* ]]; then
  command -v ip >/dev/null || fail "the 'ip' command (iproute2) is needed to find this machine's address toward $ENDPOINT_HOST"
  ROUTE="$(ip -o route get "$ROUTE_TARGET")" || fail "no route from this machine to $ENDPOINT_HOST ($ENDPOINT_IP)"
  read -r -a ROUTE_WORDS <<<"$ROUTE"
  LOCAL_ADDR="" INTERFACE="" PREVIOUS=""
  for WORD in "${ROUTE_WORDS[@]}"; do
    case "$PREVIOUS" in
      src) LOCAL_ADDR="$WORD" ;;
      dev) INTERFACE="$WORD" ;;
    esac
    PREVIOUS="$WORD"
  done
  IS_HOST=0
  if [[ "${ROUTE_WORDS[0]}" == local ]]; then
    IS_HOST=1
    LOCAL_ADDR="$ROUTE_TARGET"
    # The local route goes through lo; the others reach us on the interface that holds the address.
    INTERFACE="$(ip -o addr show to "$ROUTE_TARGET" | awk 'NR == 1 { print $2 }')"
    if (exec 3<>"/dev/tcp/$ROUTE_TARGET/$ENDPOINT_PORT") 2>/dev/null; then
      fail "port $ENDPOINT_PORT is already taken on this machine ($ROUTE_TARGET), the rendezvous endpoint; another job may be using it: choose another port in RDZV_ENDPOINT"
    fi
  fi
  [[ -n "$LOCAL_ADDR" && -n "$INTERFACE" ]] || fail "could not tell this machine's address toward $ENDPOINT_IP from: $ROUTE"
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$INTERFACE}"
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$INTERFACE}"
  RDZV_CONF="is_host=$IS_HOST,$RDZV_CONF"
  LOCAL_ADDR_ARGS=(--local-addr="$LOCAL_ADDR")
  DETECTED="this_host=$LOCAL_ADDR is_endpoint=$IS_HOST gloo_ifname=$GLOO_SOCKET_IFNAME nccl_ifname=$NCCL_SOCKET_IFNAME"
fi

echo "run_node.sh: nnodes=$NNODES nproc_per_node=$NPROC_PER_NODE rdzv_endpoint=$RDZV_ENDPOINT ($ENDPOINT_IP) rdzv_id=$RDZV_ID max_restarts=$MAX_RESTARTS rdzv_timeout=${RDZV_TIMEOUT}s $DETECTED" >&2
exec "${TORCHRUN[@]}" --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" --rdzv-conf="$RDZV_CONF" \
  "${LOCAL_ADDR_ARGS[@]}" --max-restarts="$MAX_RESTARTS" "${ENTRY_POINT[@]}" "$@"
