# Shell functions shared by the recipes' train.sh (sourced, not run).

# start_service NAME LOG READY_TEXT COMMAND...: run COMMAND in the background with its output in
# LOG, wait until LOG has READY_TEXT followed by a URL, and set SERVICE_URL to that URL. The service
# is supervised: when it dies after it was ready, it is started again with the same command on the
# same port (a `--port 0` in COMMAND becomes the port it bound first, so SERVICE_URL stays right),
# each restart logged to LOG and stderr; clients retry their calls meanwhile. After SERVICE_RESTARTS
# (5) restarts in a row (a service that ran for 10 minutes before dying starts the count again), or
# if it dies before it was first ready, its log is shown and the script stops. The service is
# stopped when the script exits.
start_service() {
  local name=$1 log=$2 ready=$3
  shift 3
  : > "$log"
  _supervise_service "$name" "$log" "$ready" "$@" &
  local pid=$!
  # shellcheck disable=SC2064  # the pid is meant to be expanded now
  trap "kill $pid 2>/dev/null || true" EXIT
  SERVICE_URL=
  for _ in $(seq 6000); do  # building a large index takes a while; a small one, a second
    SERVICE_URL=$(_service_url "$log" "$ready")
    [ -n "$SERVICE_URL" ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "the $name did not start" >&2; exit 1; }
    sleep 0.1
  done
  echo "the $name was not ready after 10 minutes: $log" >&2
  exit 1
}

# _service_url LOG READY_TEXT: the URL after the first READY_TEXT in LOG, or nothing
_service_url() {
  grep -o "$2 http://[^ ]*" "$1" | grep -o 'http://[^ ]*' | head -1 || true
}

# _supervise_service NAME LOG READY_TEXT COMMAND...: start_service's background half; runs COMMAND
# and restarts it when it dies after it was first ready. On SIGTERM it stops the service and exits.
_supervise_service() {
  local name=$1 log=$2 ready=$3 restarts=0 max=${SERVICE_RESTARTS:-5} child="" started status url port
  shift 3
  trap '[ -n "$child" ] && kill "$child" 2>/dev/null; exit 0' TERM
  while true; do
    started=$SECONDS
    "$@" >> "$log" 2>&1 &
    child=$!
    status=0
    wait "$child" || status=$?
    url=$(_service_url "$log" "$ready")
    [ -n "$url" ] || exit 1  # never ready: start_service shows the log and stops the script
    kill -0 $$ 2>/dev/null || exit 0  # the script is gone: nobody needs the service
    if [ $((SECONDS - started)) -ge 600 ]; then restarts=0; fi
    if [ "$restarts" -ge "$max" ]; then
      { tail -n 30 "$log"; echo "the $name at $url died (status $status) after $max restarts in a row; stopping"; } >&2
      # The script's process group (torchrun and all), or, if the script does not lead one, the script.
      kill -TERM -- -$$ 2>/dev/null || kill -TERM $$
      exit 1
    fi
    restarts=$((restarts + 1))
    port=${url##*:}
    port=${port%%/*}
    local args=() previous=""
    for arg in "$@"; do  # the port it bound first, for a service started on any free port
      if [ "$previous" = --port ] && [ "$arg" = 0 ]; then arg=$port; fi
      if [ "$arg" = --port=0 ]; then arg=--port=$port; fi
      args+=("$arg")
      previous=$arg
    done
    set -- "${args[@]}"
    echo "[start_service] the $name at $url died (status $status); restarting it ($restarts/$max): $*" \
      | tee -a "$log" >&2
    sleep 1
  done
}

# tiny_warmup TOOL: the tiny variants' SFT warm-up on demonstrations of TOOL (python or search)
# made from $OUT/data/train.jsonl, from $MODEL on $NPROC ranks; sets MODEL to its checkpoint. A
# random-init model never writes a tool call by chance; a real one needs no warm-up.
tiny_warmup() {
  local steps=${WARMUP_STEPS:-150}
  echo "== warm-up: $steps SFT steps on $1 tool demonstrations (tiny variant only)"
  python recipes/make_tool_demos.py --tool "$1" --rows "$OUT/data/train.jsonl" --out "$OUT/data/demos.jsonl"
  if [ ! -f "$OUT/warmup/step$steps/config.json" ]; then
    torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft \
      data.path="$OUT/data/demos.jsonl" data.batch_size=8 actor.model_name="$MODEL" actor.dtype=float32 \
      actor.gradient_checkpointing=false actor.lr=5e-3 actor.max_length_per_device=2048 \
      actor.save_dir="$OUT/warmup" trainer.total_steps="$steps" trainer.disable_wandb=true trainer.load_ckpt_from=latest
  fi
  MODEL=$OUT/warmup/step$steps
}
