#!/usr/bin/env bash
# One task of a job step (started by srun from slurm/lib.sh): its own log file, then the command.
#
#   task.sh train LOG_DIR -- CMD...               # log LOG_DIR/train-NODE-rankR.log
#   task.sh serve NAME ADDR LOG_DIR -- CMD...     # a server (engine or router): on the step's first
#                                                 # node pick a free port, append --port P, publish
#                                                 # http://ADDR:P in LOG_DIR/endpoints/NAME.url; on
#                                                 # the other nodes of a multi-node engine append
#                                                 # --node-rank (SGLang serves HTTP from node rank 0);
#                                                 # the job's API key from the environment (below)
set -euo pipefail

node=${SLURMD_NODENAME:-$(hostname -s)}
role=$1
shift
case "$role" in
train)
  log_dir=$1
  shift
  [[ $1 == -- ]] && shift
  exec >>"$log_dir/train-$node-rank${SLURM_PROCID:-0}.log" 2>&1
  echo "[$(date '+%F %T')] rank ${SLURM_PROCID:-0} of ${SLURM_NTASKS:-1} on $node: $*"
  exec "$@"
  ;;
serve)
  name=$1 addr=$2 log_dir=$3
  shift 3
  [[ $1 == -- ]] && shift
  exec >>"$log_dir/$name-$node.log" 2>&1
  node_rank=${SLURM_NODEID:-0}
  args=("$@")
  if ((node_rank == 0)); then
    port=$("${PYTHON:-python3}" "$(dirname "$0")/jobplan.py" free-port)
    args+=(--port "$port")
    mkdir -p "$log_dir/endpoints"
    echo "http://$addr:$port" >"$log_dir/endpoints/$name.url.tmp"
    mv "$log_dir/endpoints/$name.url.tmp" "$log_dir/endpoints/$name.url"
  fi
  if ((${SLURM_NNODES:-1} > 1)); then
    args+=(--node-rank "$node_rank")
  fi
  echo "[$(date '+%F %T')] $name on $node (node rank $node_rank): ${args[*]}"
  # The job's key ($MEGATRON_RL_ENGINE_API_KEY, from lib.sh's 0600 key file): `megatron-rl serve` reads
  # it from the environment; SGLang's server and router take --api-key only, so it is appended inside
  # the interpreter (`python -c`), which keeps it off the command line `ps` shows to everyone.
  if [[ -n ${MEGATRON_RL_ENGINE_API_KEY:-} && ${args[1]:-} == -m && ${args[2]:-} != megatron_rl.cli ]]; then
    exec "${args[0]}" -c 'import os, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:], "--api-key", os.environ["MEGATRON_RL_ENGINE_API_KEY"]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)' "${args[@]:2}"
  fi
  exec "${args[@]}"
  ;;
*)
  echo "task.sh: unknown role '$role' (train or serve)" >&2
  exit 2
  ;;
esac
