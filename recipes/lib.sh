# Shell functions shared by the recipes' train.sh (sourced, not run).

# start_service NAME LOG READY_TEXT COMMAND...: run COMMAND in the background with its output in
# LOG, wait until LOG has READY_TEXT followed by a URL, and set SERVICE_URL to that URL. The service
# is stopped when the script exits; if it dies first, its log is shown and the script stops.
start_service() {
  local name=$1 log=$2 ready=$3
  shift 3
  "$@" > "$log" 2>&1 &
  local pid=$!
  # shellcheck disable=SC2064  # the pid is meant to be expanded now
  trap "kill $pid 2>/dev/null || true" EXIT
  SERVICE_URL=
  for _ in $(seq 6000); do  # building a large index takes a while; a small one, a second
    SERVICE_URL=$(grep -o "$ready http://[^ ]*" "$log" | grep -o 'http://[^ ]*' | head -1 || true)
    [ -n "$SERVICE_URL" ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "the $name did not start" >&2; exit 1; }
    sleep 0.1
  done
  echo "the $name was not ready after 10 minutes: $log" >&2
  exit 1
}

# tiny_warmup TOOL: the tiny variants' SFT warm-up on demonstrations of TOOL (python or search)
# made from $OUT/data/train.jsonl, from $MODEL on $NPROC ranks; sets MODEL to its checkpoint. A
# random-init model never writes a tool call by chance; a real one needs no warm-up.
tiny_warmup() {
  local steps=${WARMUP_STEPS:-150}
  echo "== warm-up: $steps SFT steps on $1 tool demonstrations (tiny variant only)"
  python recipes/make_tool_demos.py --tool "$1" --rows "$OUT/data/train.jsonl" --out "$OUT/data/demos.jsonl"
  if [ ! -f "$OUT/warmup/step$steps/config.json" ]; then
    torchrun --nproc_per_node="$NPROC" -m rl2.trainer.sft \
      data.path="$OUT/data/demos.jsonl" data.batch_size=16 actor.model_name="$MODEL" actor.dtype=float32 \
      actor.gradient_checkpointing=false actor.lr=5e-3 actor.max_length_per_device=2048 \
      actor.save_dir="$OUT/warmup" trainer.total_steps="$steps" trainer.disable_wandb=true
  fi
  MODEL=$OUT/warmup/step$steps
}
