#!/usr/bin/env bash
# Single-turn math GRPO (docs/guides/grpo-math.md).
#
#   TRAIN_FILES=gsm8k_train.parquet TEST_FILES=math500.jsonl bash recipes/math_grpo/train.sh   # 4 GPUs
#   TINY=1 bash recipes/math_grpo/train.sh     # CPU: tiny model, shipped samples, tiny.yaml
#
# 1. data: prepare_data.py turns GSM8K / MATH-style files into rows asking for a \boxed{} answer
# 2. GRPO with envs/math_reward.py's reward, resuming from its latest checkpoint
# 3. evaluation: trainer.eval_only=true on the test rows -> $OUT/eval/eval.json
# Extra key=value arguments go to the training run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
TINY=${TINY:-0}
if [ "$TINY" = 1 ]; then
  CONFIG=recipes/math_grpo/tiny.yaml
  OUT=${OUT:-outputs/math_grpo_tiny}
  NPROC=${NPROC:-1}
  TRAIN_FILES=${TRAIN_FILES:-recipes/math_grpo/sample/gsm8k_train.jsonl}
  TEST_FILES=${TEST_FILES:-recipes/math_grpo/sample/math_test.jsonl}
  STEPS=${STEPS:-2}
  export WANDB_MODE=${WANDB_MODE:-disabled}
  MODEL=$OUT/model
  [ -f "$MODEL/config.json" ] || python -m rl2.testing.tiny "$MODEL" --hidden-size 64 --layers 2
else
  CONFIG=recipes/math_grpo/config.yaml
  OUT=${OUT:-outputs/math_grpo}
  NPROC=${NPROC:-4}
  TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to GSM8K / MATH-style training files}
  TEST_FILES=${TEST_FILES:?set TEST_FILES to GSM8K / MATH-style test files}
  STEPS=${STEPS:-}
  MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
fi
mkdir -p "$OUT/data"

echo "== data"
# shellcheck disable=SC2086  # the file lists may hold several files
python recipes/math_grpo/prepare_data.py $(printf -- '--input %s ' $TRAIN_FILES) --output "$OUT/data/train.jsonl"
# shellcheck disable=SC2086
python recipes/math_grpo/prepare_data.py $(printf -- '--input %s ' $TEST_FILES) --output "$OUT/data/test.jsonl"

echo "== GRPO from $MODEL"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" \
  actor.model_name="$MODEL" data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
  actor.save_dir="$OUT/grpo" ${STEPS:+trainer.total_steps=$STEPS} "$@"

LAST=$(ls -d "$OUT"/grpo/step* | sed 's/.*step//' | sort -n | tail -1)
echo "== evaluation of $OUT/grpo/step$LAST"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" trainer.eval_only=true \
  actor.model_name="$OUT/grpo/step$LAST" data.test_path="$OUT/data/test.jsonl" \
  trainer.load_ckpt_from=null actor.save_dir="$OUT/eval"
echo "results: $OUT/eval/eval.json; trajectories: $OUT/grpo/trajectories/"
