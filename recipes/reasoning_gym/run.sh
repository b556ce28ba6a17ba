#!/usr/bin/env bash
# GRPO on a mix of reasoning-gym tasks (docs/guides/grpo-math.md): procedurally generated,
# verifiable problems, each scored by its task's own scorer (envs/reasoning_gym.py).
#
#   bash recipes/reasoning_gym/run.sh                       # 4 GPUs: Qwen2.5-1.5B-Instruct, config.yaml
#   TASKS=leg_counting,gcd ROWS=5000 bash recipes/reasoning_gym/run.sh
#   bash recipes/reasoning_gym/tiny.sh                      # its CPU twin
#
# 1. data: python -m rl2.data.reasoning_gym writes ROWS training and TEST_ROWS test rows of TASKS,
#    mixed (needs reasoning-gym: pip install 'rl2[envs]'); the same SEED gives the same rows
# 2. GRPO with envs/reasoning_gym.py, resuming from its latest checkpoint; test/<task>/reward_mean per task
# 3. evaluation: trainer.eval_only=true on the test rows -> $OUT/eval/eval.json
# Extra key=value arguments go to the training run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
CONFIG=${CONFIG:-recipes/reasoning_gym/config.yaml}
OUT=${OUT:-outputs/reasoning_gym}
NPROC=${NPROC:-4}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
TASKS=${TASKS:-basic_arithmetic,chain_sum,gcd,lcm,prime_factorization,leg_counting,letter_counting,spell_backward,word_sorting,number_sorting,caesar_cipher,propositional_logic}
ROWS=${ROWS:-24000}
TEST_ROWS=${TEST_ROWS:-600}
SEED=${SEED:-0}
STEPS=${STEPS:-}
mkdir -p "$OUT/data"

echo "== data: $TASKS"
python -m rl2.data.reasoning_gym "$TASKS" --rows "$ROWS" --seed "$SEED" --out "$OUT/data/train.jsonl" \
  --test-rows "$TEST_ROWS" --test-out "$OUT/data/test.jsonl"

echo "== GRPO from $MODEL"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" \
  actor.model_name="$MODEL" data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
  actor.save_dir="$OUT/grpo" trainer.seed="$SEED" ${STEPS:+trainer.total_steps=$STEPS} "$@"

LAST=$(ls -d "$OUT"/grpo/step* | sed 's/.*step//' | sort -n | tail -1)
echo "== evaluation of $OUT/grpo/step$LAST"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" trainer.eval_only=true \
  actor.model_name="$OUT/grpo/step$LAST" data.test_path="$OUT/data/test.jsonl" \
  trainer.load_ckpt_from=null actor.save_dir="$OUT/eval"
echo "results (test/<task>/reward_mean per task): $OUT/eval/eval.json; trajectories: $OUT/grpo/trajectories/"
