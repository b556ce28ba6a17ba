#!/usr/bin/env bash
# The CPU twin of run.sh: a tiny random-init model, reasoning-gym tasks mixed (TASKS), GRPO on 2 ranks
# with envs/reasoning_gym.py (tiny.yaml), evaluated at the start and every 2 steps; the test metrics
# include test/<task>/reward_mean for each task.
#
# A random model never writes <answer></answer>, so every reward would be 0 and GRPO would have
# nothing to learn from: first WARMUP_STEPS (100; 0 skips it) of SFT on the training questions
# answered with their gold answers in the tags teach it the format (its numbers stay mostly wrong),
# so that some replies score and the GRPO steps update the policy.
#
#   bash recipes/reasoning_gym/tiny.sh                        # about a minute on 2 CPU cores once installed
#   TASKS=gcd,lcm,chain_sum STEPS=6 bash recipes/reasoning_gym/tiny.sh actor.lr=1e-4
#
# Extra key=value arguments go to the GRPO run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-outputs/reasoning_gym_tiny}
NPROC=${NPROC:-2}
TASKS=${TASKS:-basic_arithmetic,chain_sum,gcd,lcm}
ROWS=${ROWS:-256}
TEST_ROWS=${TEST_ROWS:-8}
SEED=${SEED:-0}
WARMUP_STEPS=${WARMUP_STEPS:-100}
STEPS=${STEPS:-4}
export WANDB_MODE=${WANDB_MODE:-disabled}
MODEL=$OUT/model
mkdir -p "$OUT/data"
[ -f "$MODEL/config.json" ] || python -m rl2.testing.tiny "$MODEL" --hidden-size 64 --layers 2

echo "== data: $TASKS"
python -m rl2.data.reasoning_gym "$TASKS" --rows "$ROWS" --seed "$SEED" --out "$OUT/data/train.jsonl" \
  --test-rows "$TEST_ROWS" --test-out "$OUT/data/test.jsonl"

START=$MODEL
if [ "$WARMUP_STEPS" -gt 0 ]; then
  echo "== SFT warm-up on the answer format ($WARMUP_STEPS steps)"
  python - "$OUT/data/train.jsonl" "$OUT/data/sft.jsonl" <<'PY'
import json, sys
from rl2.data.reasoning_gym import read_answer
with open(sys.argv[1]) as rows, open(sys.argv[2], "w") as out:
    for line in rows:
        row = json.loads(line)
        gold = read_answer(row["answer"])[1]["answer"]
        if gold is not None:  # a few tasks have no single gold answer
            reply = {"role": "assistant", "content": f"<answer>{gold}</answer>"}
            out.write(json.dumps({"messages": row["messages"] + [reply]}) + "\n")
PY
  rm -rf "$OUT/sft"
  torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft \
    data.path="$OUT/data/sft.jsonl" data.batch_size=32 \
    actor.model_name="$MODEL" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.lr=3e-3 actor.warmup_ratio=0.1 actor.save_dir="$OUT/sft" \
    trainer.total_steps="$WARMUP_STEPS" trainer.seed="$SEED" trainer.disable_wandb=true
  START=$OUT/sft/step$WARMUP_STEPS
fi

echo "== GRPO: $STEPS steps on $NPROC ranks from $START"
rm -rf "$OUT/grpo"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config=recipes/reasoning_gym/tiny.yaml \
  actor.model_name="$START" data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
  actor.save_dir="$OUT/grpo" trainer.total_steps="$STEPS" trainer.seed="$SEED" "$@"
echo "metrics (test/<task>/reward_mean per task): $OUT/grpo/metrics.jsonl; trajectories: $OUT/grpo/trajectories/"
