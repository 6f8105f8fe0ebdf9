# shellcheck shell=bash
# The body of the sbatch scripts: `run_job MODE CONFIG [key=value ...]` (train.sbatch: disaggregated,
# train_colocated.sbatch: colocated) and `run_convert ARGS...` (convert.sbatch).
#
# run_job:
# 1. plan (slurm/jobplan.py): check the config, the node split and the trainer's parallel layout;
#    fail at once with one message naming the problem;
# 2. start the rollout servers as background job steps (one srun each), wait for their /health,
#    then distill.teacher's servers when the config distils (slurm/jobteacher.py), then an
#    sglang-router in front of the rollout servers when there is one; with rollout.sglang_urls in the config
#    (a router or servers running already) start none, wait for those, and train on every node;
# 3. run the trainer (one srun: one task per GPU, on CPU the least ranks the layout takes) with
#    rollout.engine=sglang rollout.sglang_urls=[the servers] and --resume-if-any;
# 4. record each server's final weight version (LOG_DIR/engines.json), stop every step, exit with
#    the trainer's status.
# Every step runs in a process group of its own and is stopped (SIGTERM to its tasks, SIGKILL after
# STOP_GRACE seconds) when the job ends, fails, or is cancelled (scancel, time limit, preemption).
# SIGUSR1 (the sbatch scripts' `--signal=B:USR1@300`: 300 s before the time limit) and SIGTERM to the
# batch shell first ask the trainer to checkpoint: SIGUSR1 to its tasks, which finish the current
# step, save it and exit (within TRAINER_GRACE seconds); then the servers are stopped. After SIGUSR1
# the job exits with the trainer's status (0: a chained `--dependency=afterok` job continues).
#
# Environment (all optional):
#   TRAIN_NODES        disaggregated: nodes that train, the first ones of the job (default: half; all of
#                      them, and no other value, when rollout.sglang_urls gives the servers)
#   RANKS_PER_NODE     trainer ranks per node (default: the GPUs per node; CPU: the least the layout takes)
#   GPUS_PER_NODE      GPUs per node (default: Slurm's count, else nvidia-smi's; 0 = CPU run)
#   RESUME             1 (default): --resume-if-any (the newest checkpoint, or a fresh start in a run folder
#                      that holds no run; a run without a usable checkpoint is refused); 0: start over
#   ROUTER             1/0: sglang-router in front of the engines (default: 1 in a disaggregated GPU job when
#                      sglang_router imports; colocated jobs refuse it: its health checks reach released engines)
#   ROUTER_POLICY      the router's --policy (default cache_aware)
#   SGLANG_ARGS        extra sglang.launch_server arguments (e.g. "--mem-fraction-static 0.7 --ep-size 8")
#   LOCAL_ENGINE_ARGS  extra `megatron-rl serve` arguments (CPU runs)
#   TEACHER_NODES      with distill.teacher (on-policy distillation): the last rollout nodes that serve the
#                      teacher (default 1; on GPUs they serve it alone, on CPU beside their engine)
#   TEACHER_GPUS       GPUs of one teacher server (default rollout.engine_gpus)
#   TEACHER_ARGS       extra arguments of the teacher's servers (SGLANG_ARGS and LOCAL_ENGINE_ARGS do not reach them)
#   ENGINE_BIND        address the servers bind (default: 127.0.0.1 on a one-node job, else each server's
#                      node address; never 0.0.0.0 unless asked for). Every server requires the job's
#                      API key (rollout.api_key, else a random one: RUN_DIR/logs/job-ID/engine_api_key)
#   ENGINE_TIMEOUT     seconds for the servers to answer /health (default 1800)
#   STOP_GRACE         seconds between SIGTERM and SIGKILL when stopping steps (default 30)
#   TRAINER_GRACE      seconds the trainer gets to finish its step and checkpoint after SIGUSR1 or
#                      SIGTERM reach the batch shell (default 240; keep it below --signal's lead time)
#   PYTHON             interpreter with megatron-rl installed (default: python on PATH)
#   SGLANG_PYTHON      interpreter of the SGLang servers and the router (default: $PYTHON); sglang 0.5.23
#                      pins its own torch and transformers, so it may live in an environment of its own
#   NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE  exported to every step of a GPU job (default 0 and 0, SGLang's
#                      own defaults), so trainer and engines agree in the weight-update group
#   DRY_RUN            1: print the plan and the commands, start nothing; outside a Slurm job (bash
#                      slurm/train.sbatch ...) it plans for NODES nodes (default: 2 for train.sbatch, 1 for
#                      train_colocated.sbatch) named node1..nodeN, and GPUS_PER_NODE GPUs (default 0: CPU)

say() { echo "[$(date '+%F %T')] $*"; }
die() {
  say "error: $*" >&2
  exit 2
}
join_by() {
  local IFS=$1
  shift
  echo "$*"
}

# ---- steps and their end ----
BG_PIDS=()
BG_NAMES=()
CLEANED=0

# start_step NAME CMD...: CMD (an srun) in the background, in a process group of its own.
start_step() {
  local name=$1
  shift
  setsid "$@" </dev/null &
  BG_PIDS+=("$!")
  BG_NAMES+=("$name")
}

# The step's srun or anything of its process group still runs (zombies aside: srun leaves a child
# that PID 1 may reap late; right after the fork the group may not exist yet).
group_alive() {
  ps -eo pid=,pgid=,stat= | awk -v g="$1" '($1 == g || $2 == g) && $3 !~ /^Z/ {found = 1} END {exit !found}'
}

# The id (JOB.STEP) of this job's running step named NAME, if any; none outside a job (squeue would
# wait its message timeout for a controller that may not exist).
step_id() {
  [[ -n ${SLURM_JOB_ID:-} ]] || return 0
  squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$1" '$2 == n {print $1; exit}'
}

# Stop every step, the newest first (the trainer before the servers it uses): SIGTERM to the step's
# tasks (srun itself would turn a SIGTERM into SIGKILL for them), SIGKILL after STOP_GRACE seconds.
stop_steps() {
  local grace=${STOP_GRACE:-30} i pid sid alive deadline
  for ((i = ${#BG_PIDS[@]} - 1; i >= 0; i--)); do
    pid=${BG_PIDS[$i]}
    group_alive "$pid" || continue
    say "stopping ${BG_NAMES[$i]}"
    sid=$(step_id "${BG_NAMES[$i]}")
    if [[ -n $sid ]]; then
      scancel --signal=TERM "$sid" 2>/dev/null || true
    else
      kill -TERM -- "-$pid" 2>/dev/null || true
    fi
  done
  deadline=$((SECONDS + grace))
  while :; do
    alive=0
    for pid in "${BG_PIDS[@]}"; do group_alive "$pid" && alive=1; done
    ((alive == 0 || SECONDS >= deadline)) && break
    sleep 0.2
  done
  for i in "${!BG_PIDS[@]}"; do
    pid=${BG_PIDS[$i]}
    group_alive "$pid" || continue
    say "${BG_NAMES[$i]} still running after ${grace} s: killing it"
    sid=$(step_id "${BG_NAMES[$i]}")
    [[ -n $sid ]] && scancel "$sid" 2>/dev/null
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}

cleanup() {
  ((CLEANED)) && return 0
  CLEANED=1
  stop_steps
}

# The trainer's srun, once started: a stop signal asks it to checkpoint before the steps are stopped.
TRAINER_PID=""

# SIGUSR1 to the trainer's tasks (each finishes its step, saves a checkpoint, exits); waits up to
# TRAINER_GRACE seconds; returns the trainer's exit status (1 if it was still running).
checkpoint_trainer() {
  [[ -n $TRAINER_PID ]] && group_alive "$TRAINER_PID" || return 1
  local grace=${TRAINER_GRACE:-240} sid rc=0 deadline
  say "asking the trainer to checkpoint after its current step and stop (SIGUSR1, up to $grace s)"
  sid=$(step_id trainer)
  if [[ -n $sid ]]; then
    scancel --signal=USR1 "$sid" 2>/dev/null || true
  else
    kill -USR1 "$TRAINER_PID" 2>/dev/null || true # srun passes it on to the tasks
  fi
  deadline=$((SECONDS + grace))
  while group_alive "$TRAINER_PID" && ((SECONDS < deadline)); do sleep 0.5; done
  group_alive "$TRAINER_PID" && return 1
  wait "$TRAINER_PID" || rc=$?
  return "$rc"
}

on_signal() {
  say "received SIG$1: stopping the job's steps"
  trap - TERM INT HUP USR1
  local rc=$((128 + $2))
  if [[ $1 == USR1 ]]; then
    checkpoint_trainer && rc=0
  elif [[ $1 == TERM ]]; then
    checkpoint_trainer || true
  fi
  cleanup
  exit "$rc"
}

install_traps() {
  trap cleanup EXIT
  trap 'on_signal TERM 15' TERM
  trap 'on_signal INT 2' INT
  trap 'on_signal HUP 1' HUP
  trap 'on_signal USR1 10' USR1
}

# ---- the job's nodes ----
# Outside a job (a dry run): NODES nodes named node1..nodeN, each its own address.
job_nodes() {
  if [[ -n ${SLURM_JOB_ID:-} ]]; then
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  else
    seq -f 'node%g' "${NODES:-$1}"
  fi
}

# Slurm's NodeAddr of a node: what the other nodes connect to.
node_addr() {
  local addr=""
  [[ -n ${SLURM_JOB_ID:-} ]] && addr=$(scontrol show node "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  echo "${addr:-$1}"
}

detect_gpus() {
  if [[ -n ${GPUS_PER_NODE:-} ]]; then
    echo "$GPUS_PER_NODE"
  elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    echo "$SLURM_GPUS_ON_NODE"
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU'
  else
    echo 0
  fi
}

require_job() {
  [[ -n ${SLURM_JOB_ID:-} || ${DRY_RUN:-0} == 1 ]] ||
    die "submit this script with sbatch (no SLURM_JOB_ID), or set DRY_RUN=1"
  PYTHON=${PYTHON:-$(command -v python || command -v python3)}
  SGLANG_PYTHON=${SGLANG_PYTHON:-$PYTHON}
  export PYTHON SGLANG_PYTHON
}

show_tail() {
  local file
  for file in "$@"; do
    [[ -s $file ]] || continue
    echo "---- last lines of $file"
    tail -n 30 "$file"
  done
}

# ---- servers ----
# wait_url NAME PID: the URL a server step publishes in LOG_DIR/endpoints once it has a port.
wait_url() {
  local name=$1 pid=$2 file="$LOG_DIR/endpoints/$1.url" deadline=$((SECONDS + ${ENGINE_TIMEOUT:-1800}))
  until [[ -s $file ]]; do
    if ! group_alive "$pid"; then
      show_tail "$LOG_DIR/$name"-*.log >&2
      die "$name ended before it started serving (logs: $LOG_DIR/$name-*.log)"
    fi
    ((SECONDS < deadline)) || die "$name published no address within ${ENGINE_TIMEOUT:-1800} s"
    sleep 0.2
  done
  cat "$file"
}

# start_server NAME ADDR NODES(comma) EXTRA_SRUN_ARGS... -- CMD...
start_server() {
  local name=$1 addr=$2 hosts=$3
  shift 3
  local -a srun_args=()
  while [[ $1 != -- ]]; do
    srun_args+=("$1")
    shift
  done
  shift
  local count
  count=$(tr ',' '\n' <<<"$hosts" | wc -l)
  start_step "$name" srun --kill-on-bad-exit=1 --export=ALL "${srun_args[@]}" --nodes="$count" \
    --ntasks-per-node=1 --nodelist="$hosts" --job-name="$name" \
    bash "$SLURM_DIR/task.sh" serve "$name" "$addr" "$LOG_DIR" -- "$@"
}

# start_servers KIND (engine: the policy's, ENGINE_*; teacher: distillation's, TEACHER_*): starts every
# server of the plan and waits for them; sets SERVER_URLS.
start_servers() {
  local kind=$1 prefix=${1^^} i url
  local -n count="${prefix}_COUNT"
  local -a pids=()
  SERVER_URLS=()
  for ((i = 0; i < count; i++)); do
    local -n cmd="${prefix}_CMD_$i" hosts="${prefix}_NODES_$i" addr="${prefix}_ADDR_$i"
    # --overlap: several servers (and, colocated, the trainer) share a node's GPUs; each picks its own
    # with --base-gpu-id, so every step sees all of them
    start_server "$kind$i" "$addr" "$(join_by , "${hosts[@]}")" --overlap -- "${cmd[@]}"
    pids+=("${BG_PIDS[-1]}")
    unset -n cmd hosts addr
  done
  for ((i = 0; i < count; i++)); do
    url=$(wait_url "$kind$i" "${pids[$i]}") || exit 2
    SERVER_URLS+=("$url")
  done
  say "waiting for ${SERVER_URLS[*]} to answer /health"
  "$PYTHON" "$SLURM_DIR/jobplan.py" wait-healthy --timeout "${ENGINE_TIMEOUT:-1800}" --pids "$(join_by , "${pids[@]}")" \
    "${SERVER_URLS[@]}" || {
    show_tail "$LOG_DIR/$kind"*.log
    die "the $kind servers did not start"
  }
}

# The servers (or router) of rollout.sglang_urls, which the job does not start: their key is the
# config's rollout.api_key, else the submission's $MEGATRON_RL_ENGINE_API_KEY. Sets ENGINE_URLS.
use_external_servers() {
  ENGINE_URLS=("${EXTERNAL_URLS[@]}")
  [[ -n $ENGINE_API_KEY ]] && export MEGATRON_RL_ENGINE_API_KEY=$ENGINE_API_KEY
  say "no server of its own: waiting for rollout.sglang_urls ${ENGINE_URLS[*]} to answer /health"
  "$PYTHON" "$SLURM_DIR/jobplan.py" wait-healthy --timeout "${ENGINE_TIMEOUT:-1800}" "${ENGINE_URLS[@]}" ||
    die "the servers of rollout.sglang_urls did not answer /health"
}

start_router() {
  local -n hosts="ENGINE_NODES_0" addr="ENGINE_ADDR_0"
  start_server router "$addr" "${hosts[0]}" --overlap -- "$SGLANG_PYTHON" -m sglang_router.launch_router \
    --worker-urls "${ENGINE_URLS[@]}" --host "$addr" --policy "${ROUTER_POLICY:-cache_aware}"
  local url pid=${BG_PIDS[-1]}
  url=$(wait_url router "$pid") || exit 2
  "$PYTHON" "$SLURM_DIR/jobplan.py" wait-healthy --timeout 300 --pids "$pid" "$url" || {
    show_tail "$LOG_DIR"/router-*.log
    die "the sglang-router did not start"
  }
  say "router $url in front of the servers (for clients besides the trainer, which updates every server itself)"
}

# write_job_key FILE: every server of the job requires a key: rollout.api_key, else one made for this
# job. It lives in FILE (mode 0600, in the run folder) and reaches each step in the environment
# ($MEGATRON_RL_ENGINE_API_KEY, read by the trainer, `megatron-rl serve`, jobplan.py and task.sh),
# never on a command line that `ps` or `scontrol` shows to other users.
write_job_key() {
  local file=$1
  (
    umask 077
    if [[ -n $ENGINE_API_KEY ]]; then
      printf '%s' "$ENGINE_API_KEY" >"$file"
    else
      "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32), end="")' >"$file"
    fi
  ) || die "cannot write the job's API key file $file"
  chmod 600 "$file"
  MEGATRON_RL_ENGINE_API_KEY=$(<"$file")
  export MEGATRON_RL_ENGINE_API_KEY
}

# default_router MODE GPUS: 1 when a disaggregated GPU job can start an sglang-router, else 0 (the
# engines of a colocated job release their memory: the router's health checks must not reach them)
default_router() {
  if [[ $1 == disaggregated ]] && (($2 > 0)) && "$SGLANG_PYTHON" -c "import sglang_router" 2>/dev/null; then
    echo 1
  else
    echo 0
  fi
}

# ---- the training job ----
run_job() {
  local mode=$1
  shift
  require_job
  local script=train
  [[ $mode == colocated ]] && script=train_colocated
  (($# >= 1)) || die "usage: sbatch [options] slurm/$script.sbatch CONFIG [key=value ...]"
  local config=$1
  shift
  local -a overrides=("$@") nodes=() addrs=()
  local started=$SECONDS n gpus engine_args plan job_id=${SLURM_JOB_ID:-dry-run} default_nodes=2
  [[ $mode == colocated ]] && default_nodes=1
  mapfile -t nodes < <(job_nodes "$default_nodes")
  for n in "${nodes[@]}"; do addrs+=("$(node_addr "$n")"); done
  gpus=$(detect_gpus)
  engine_args=${LOCAL_ENGINE_ARGS:-}
  ((gpus > 0)) && engine_args=${SGLANG_ARGS:-}
  local -a plan_args=(--mode "$mode" --job-id "$job_id" --gpus-per-node "$gpus"
    --nodes "$(join_by , "${nodes[@]}")" --addrs "$(join_by , "${addrs[@]}")"
    --train-nodes "${TRAIN_NODES:-}" --ranks-per-node "${RANKS_PER_NODE:-}" --router "${ROUTER:-}"
    --bind "${ENGINE_BIND:-auto}" --engine-args "$engine_args" --sglang-python "$SGLANG_PYTHON"
    --teacher-nodes "${TEACHER_NODES:-}" --teacher-gpus "${TEACHER_GPUS:-}" "--teacher-args=${TEACHER_ARGS:-}")

  say "job $job_id ($mode): ${#nodes[@]} node(s) ${nodes[*]}, $gpus GPU(s) per node; $config ${overrides[*]}"
  plan=$("$PYTHON" "$SLURM_DIR/jobplan.py" plan "${plan_args[@]}" "$config" "${overrides[@]}") || exit 2
  eval "$plan" # also exports the NCCL settings of a GPU job, before any step starts
  [[ $START_ROUTER == auto ]] && START_ROUTER=$(default_router "$PLAN_MODE" "$gpus")
  local -a overlap=()
  [[ $PLAN_MODE == colocated ]] && overlap=(--overlap) # the trainer shares the nodes with the engines
  local -a resume=()
  [[ ${RESUME:-1} == 1 ]] && resume=(--resume-if-any) # a first job starts afresh; a damaged run is refused
  local -a trainer=("$PYTHON" -m megatron_rl.cli train "$config" "${PRESET_OVERRIDES[@]}" "${overrides[@]}" "${TRAINER_OVERRIDES[@]}")
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    local i urls='rollout.sglang_urls=[...]'
    ((${#EXTERNAL_URLS[@]})) && urls="(the config's rollout.sglang_urls: ${EXTERNAL_URLS[*]})"
    for ((i = 0; i < ENGINE_COUNT; i++)); do
      local -n cmd="ENGINE_CMD_$i" hosts="ENGINE_NODES_$i"
      say "engine$i on $(join_by , "${hosts[@]}"): ${cmd[*]}"
      unset -n cmd hosts
    done
    for ((i = 0; i < TEACHER_COUNT; i++)); do
      local -n cmd="TEACHER_CMD_$i" hosts="TEACHER_NODES_$i"
      say "teacher$i on $(join_by , "${hosts[@]}"): ${cmd[*]}"
      unset -n cmd hosts
    done
    ((TEACHER_COUNT)) && urls+=' distill.teacher_urls=[...]'
    ((START_ROUTER)) && say "router on ${ENGINE_NODES_0[0]}: sglang_router.launch_router --worker-urls ..."
    say "trainer on $(join_by , "${TRAIN_HOSTS[@]}") x $RANKS_PER_NODE ranks: ${trainer[*]} $urls ${resume[*]}"
    return 0
  fi
  mkdir -p "$LOG_DIR/endpoints"
  rm -f "$LOG_DIR"/endpoints/*.url
  install_traps
  if ((${#EXTERNAL_URLS[@]})); then
    use_external_servers
    trainer+=("${resume[@]}")
  else
    write_job_key "$LOG_DIR/engine_api_key"
    start_servers engine
    ENGINE_URLS=("${SERVER_URLS[@]}")
    say "$ENGINE_COUNT rollout server(s) healthy after $((SECONDS - started)) s"
    if ((TEACHER_COUNT)); then # distill.teacher: weights that never change, so no sync and no router reach them
      start_servers teacher
      say "$TEACHER_COUNT teacher server(s) healthy after $((SECONDS - started)) s"
      trainer+=("distill.teacher_urls=[$(printf '"%s",' "${SERVER_URLS[@]}" | sed 's/,$//')]")
    fi
    ((START_ROUTER)) && start_router
    # the trainer talks to each server itself: weight updates must reach every one
    trainer+=("rollout.sglang_urls=[$(printf '"%s",' "${ENGINE_URLS[@]}" | sed 's/,$//')]" "${resume[@]}")
  fi
  MASTER_PORT=$("$PYTHON" "$SLURM_DIR/jobplan.py" free-port)
  export MASTER_ADDR MASTER_PORT
  unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK # Slurm's variables give the ranks
  local cpus=1
  if [[ $PLAN_MODE == disaggregated && -n ${SLURM_CPUS_ON_NODE:-} ]]; then
    cpus=$((SLURM_CPUS_ON_NODE / RANKS_PER_NODE))
    ((cpus >= 1)) || cpus=1
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$cpus}
  say "trainer: $(join_by , "${TRAIN_HOSTS[@]}") x $RANKS_PER_NODE ranks, master $MASTER_ADDR:$MASTER_PORT: ${trainer[*]}"
  start_step trainer srun --kill-on-bad-exit=1 --export=ALL "${overlap[@]}" --nodes="${#TRAIN_HOSTS[@]}" \
    --ntasks-per-node="$RANKS_PER_NODE" --cpus-per-task="$cpus" --nodelist="$(join_by , "${TRAIN_HOSTS[@]}")" \
    --job-name=trainer bash "$SLURM_DIR/task.sh" train "$LOG_DIR" -- "${trainer[@]}"
  TRAINER_PID=${BG_PIDS[-1]}
  local rc=0
  wait "${BG_PIDS[-1]}" || rc=$?
  if ((rc == 0)); then
    say "trainer finished after $((SECONDS - started)) s"
  else
    show_tail "$LOG_DIR"/train-*-rank0.log
    say "trainer failed (exit $rc); logs in $LOG_DIR"
  fi
  "$PYTHON" "$SLURM_DIR/jobplan.py" weight-versions --out "$LOG_DIR/engines.json" "${ENGINE_URLS[@]}" 2>&1 || true
  cleanup
  return "$rc"
}

# ---- conversion ----
# run_convert ARGS...: `megatron-rl convert ARGS` on every node of the job, one rank per GPU
# (RANKS_PER_NODE; CPU default 1); the ranks spread the model (--tp/--pp/--ep), not the result.
run_convert() {
  require_job
  (($# >= 1)) || die "usage: sbatch [options] slurm/convert.sbatch hf-to-megatron|megatron-to-hf ARGS (see megatron-rl convert --help)"
  local -a nodes=()
  mapfile -t nodes < <(job_nodes)
  local gpus ranks
  gpus=$(detect_gpus)
  ranks=${RANKS_PER_NODE:-$gpus}
  [[ $ranks =~ ^[0-9]+$ ]] || die "RANKS_PER_NODE=$ranks is not an integer"
  ((ranks >= 1)) || ranks=1
  MASTER_ADDR=$(node_addr "${nodes[0]}")
  MASTER_PORT=$("$PYTHON" "$SLURM_DIR/jobplan.py" free-port)
  export MASTER_ADDR MASTER_PORT
  unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  install_traps
  say "job $SLURM_JOB_ID: convert on ${#nodes[@]} node(s) x $ranks ranks: megatron-rl convert $*"
  start_step convert srun --kill-on-bad-exit=1 --export=ALL --label --nodes="${#nodes[@]}" --ntasks-per-node="$ranks" \
    --job-name=convert "$PYTHON" -m megatron_rl.cli convert "$@"
  local rc=0
  wait "${BG_PIDS[-1]}" || rc=$?
  say "convert exited with $rc"
  cleanup
  return "$rc"
}
