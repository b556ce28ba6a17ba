#!/usr/bin/env bash
# rStar-Math: self-evolved deep thinking with MCTS and a process preference model (docs/guides/rstar-math.md).
#
#   bash recipes/rstar_math/train.sh           # GPUs: Qwen2.5-Math-7B-Instruct, config.yaml
#   TINY=1 bash recipes/rstar_math/train.sh    # CPU: tiny model, addition problems, tiny.yaml
#
# 1. data: prepare_data.py turns TRAIN_FILE and TEST_FILE ({problem, answer} rows) into RL rows whose
#    system prompt asks for code-augmented steps
# 2. round 1: terminal-guided MCTS (every finished solution worth +1 / -1 by the env's reward_fn)
#    over the training problems -> SFT rows (the best correct solutions) and step-level PPM pairs
# 3. the policy is fine-tuned on round 1's SFT rows, and the PPM (a reward model) trained on its pairs
# 4. round 2: PPM-guided MCTS with the new policy (the PPM scores every step; finished solutions still
#    +1 / -1) -> round 2's SFT rows and pairs, for a next round
# 5. evaluation on the test problems: greedy vs best-of-N vs step-level beam search vs MCTS, the PPM
#    choosing the answer without seeing the reference (search.terminal_value=ppm) -> $OUT/eval/report.json
#
# Extra key=value arguments go to every search.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
TINY=${TINY:-0}
if [ "$TINY" = 1 ]; then
  CONFIG=recipes/rstar_math/tiny.yaml
  OUT=${OUT:-outputs/rstar_math_tiny}
  NPROC=${NPROC:-2}
  SFT_STEPS=${SFT_STEPS:-4}; PPM_STEPS=${PPM_STEPS:-4}; WARMUP_STEPS=${WARMUP_STEPS:-120}
  export WANDB_MODE=${WANDB_MODE:-disabled}
  mkdir -p "$OUT/data"
  python recipes/rstar_math/prepare_data.py --arithmetic 16 --seed 0 --output "$OUT/data/train.jsonl"
  python recipes/rstar_math/prepare_data.py --arithmetic 8 --seed 1 --output "$OUT/data/test.jsonl"
  MODEL=$OUT/model
  [ -f "$MODEL/config.json" ] || python -m rl2.testing.tiny "$MODEL" --hidden-size 64 --layers 2
  echo "== warm-up: $WARMUP_STEPS SFT steps on step-format demonstrations (tiny variant only)"
  python recipes/rstar_math/make_step_demos.py --rows "$OUT/data/train.jsonl" --out "$OUT/data/demos.jsonl"
  if [ ! -f "$OUT/warmup/step$WARMUP_STEPS/config.json" ]; then
    torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft config="$CONFIG" data.path="$OUT/data/demos.jsonl" \
      actor.model_name="$MODEL" actor.lr=5e-3 actor.save_dir="$OUT/warmup" trainer.total_steps="$WARMUP_STEPS" \
      trainer.load_ckpt_from=latest
  fi
  MODEL=$OUT/warmup/step$WARMUP_STEPS
else
  CONFIG=recipes/rstar_math/config.yaml
  OUT=${OUT:-outputs/rstar_math}
  NPROC=${NPROC:-8}
  SFT_STEPS=${SFT_STEPS:-500}; PPM_STEPS=${PPM_STEPS:-500}
  TRAIN_FILE=${TRAIN_FILE:?set TRAIN_FILE to a JSON lines file of {problem, answer} rows, e.g. NuminaMath}
  TEST_FILE=${TEST_FILE:?set TEST_FILE to a JSON lines file of {problem, answer} rows, e.g. MATH-500}
  MODEL=${MODEL:-Qwen/Qwen2.5-Math-7B-Instruct}
  mkdir -p "$OUT/data"
  python recipes/rstar_math/prepare_data.py --input "$TRAIN_FILE" --output "$OUT/data/train.jsonl"
  python recipes/rstar_math/prepare_data.py --input "$TEST_FILE" --output "$OUT/data/test.jsonl"
fi
BASE=$MODEL  # each round fine-tunes the policy and the PPM from here, on that round's data

# search NAME POLICY DATA [key=value ...]: one search run; its outputs go to $OUT/NAME/<mode>/
search() {
  local name=$1 policy=$2 data=$3
  shift 3
  echo "== $name: search with $policy over $data"
  torchrun --standalone --nproc_per_node="$NPROC" -m rl2.search config="$CONFIG" actor.model_name="$policy" \
    data.path="$data" search.output_dir="$OUT/$name" "$@"
}

# require_rows FILE WHAT: stop when a round produced no training rows
require_rows() {
  if [ ! -s "$1" ]; then
    echo "no $2 in $1 (see $OUT/*/report.json): the policy solved nothing; stopping" >&2
    exit 1
  fi
}

search round1 "$BASE" "$OUT/data/train.jsonl" search.modes=[mcts] search.terminal_value=env search.ppm_path=null "$@"
require_rows "$OUT/round1/mcts/sft.jsonl" "SFT rows"
require_rows "$OUT/round1/mcts/ppm_pairs.jsonl" "PPM pairs"

echo "== policy: $SFT_STEPS SFT steps on round 1's best solutions"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft config="$CONFIG" data.path="$OUT/round1/mcts/sft.jsonl" \
  actor.model_name="$BASE" actor.save_dir="$OUT/policy1" trainer.total_steps="$SFT_STEPS" trainer.load_ckpt_from=latest
POLICY=$OUT/policy1/step$SFT_STEPS

echo "== PPM: $PPM_STEPS reward-model steps on round 1's step-level pairs"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.rm config="$CONFIG" data.path="$OUT/round1/mcts/ppm_pairs.jsonl" \
  critic.model_name="$BASE" critic.save_dir="$OUT/ppm1" trainer.total_steps="$PPM_STEPS" trainer.load_ckpt_from=latest
PPM=$OUT/ppm1/step$PPM_STEPS

search round2 "$POLICY" "$OUT/data/train.jsonl" search.modes=[mcts] search.terminal_value=env \
  search.ppm_path="$PPM" "$@"

search eval "$POLICY" "$OUT/data/test.jsonl" search.modes=[greedy,best_of_n,beam,mcts] \
  search.terminal_value=ppm search.ppm_path="$PPM" "$@"
echo "results: $OUT/eval/report.json; round 2's data: $OUT/round2/mcts/{sft,ppm_pairs}.jsonl"
