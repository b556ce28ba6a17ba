#!/usr/bin/env bash
# The CPU demo of vision-language RL (make demo-vision): a tiny random-init Qwen2.5-VL (rl2.testing.tiny_vlm),
# a short SFT warm-up on rows with images, then GRPO on NPROC ranks.
#
# The task (rl2.testing.vision_task): 56x56 images drawn with PIL, 1-4 shapes of one colour, each in its own
# quadrant; "How many shapes?" is answered with a digit, "What colour?" with the colour's letter (r g b y),
# each one token; envs/demo_vision.py rewards the exact answer. The warm-up (250 steps at lr 1e-3) learns the
# format and the colours (greedy 97% on the test set) but counts poorly (31%; 44% of answers sampled at
# temperature 1 are right): GRPO has to learn to count. At lr 3e-3 the warm-up never reads the image (it
# settles on the answers' prior); with noisy labels (LABEL_ACCURACY=0.5) it does not within 400 steps.
# GRPO (300 steps) lifts greedy counting to 65-100% (test reward 0.70-0.75 -> 0.86-1.00 over 2 seeds x {1, 2}
# ranks, ~3 min on 2 CPU cores; bench/RESULTS.md, 2026-11-28).
#
# The vision tower trains too (actor.freeze_vision=false): the tiny model's is random. Extra key=value
# arguments go to the PPO trainer; SFT_STEPS, SFT_LR, PPO_STEPS, SEED, SFT_CKPT and PPO_STEPS=0 work as in
# recipes/ppo_tiny.sh. `python -c "from rl2.testing.vision_task import greedy_accuracy; print(greedy_accuracy(
# '<checkpoint>', '<OUT>/data/test.jsonl'))"` scores a checkpoint without an engine.
set -euo pipefail
TORCHRUN=${TORCHRUN:-python -m torch.distributed.run}
OUT=${OUT:-outputs/ppo_vision_tiny}
NPROC=${NPROC:-2}
SFT_STEPS=${SFT_STEPS:-250}
PPO_STEPS=${PPO_STEPS:-300}
SEED=${SEED:-42}
SFT_LR=${SFT_LR:-1e-3}
LABEL_ACCURACY=${LABEL_ACCURACY:-1.0}
export WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || python -m rl2.testing.tiny_vlm "$OUT/model" --family qwen2_5_vl
[ -f "$OUT/data/test.jsonl" ] || python -m rl2.testing.vision_task "$OUT/data" --rows 4000 \
    --label-accuracy "$LABEL_ACCURACY"

if [ -n "${SFT_CKPT:-}" ]; then
  START="$SFT_CKPT"
else
  START="$OUT/sft/step$SFT_STEPS"
  echo "== SFT warm-up ($SFT_STEPS steps, rows with images)"
  rm -rf "$OUT/sft"
  $TORCHRUN --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft \
      data.path="$OUT/data/sft.jsonl" data.batch_size=64 \
      actor.model_name="$OUT/model" actor.dtype=float32 actor.gradient_checkpointing=false \
      actor.freeze_vision=false actor.lr="$SFT_LR" actor.warmup_ratio=0.2 actor.save_dir="$OUT/sft" \
      trainer.total_steps="$SFT_STEPS" trainer.seed="$SEED" trainer.disable_wandb=true
fi

if [ "$PPO_STEPS" = 0 ]; then
  echo "warm-up: $START"
  exit 0
fi
echo "== GRPO ($PPO_STEPS steps, env envs/demo_vision.py)"
rm -rf "$OUT/ppo"
$TORCHRUN --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo \
    data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
    data.prompts_per_rollout=16 data.responses_per_prompt=8 \
    actor.model_name="$START" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.freeze_vision=false actor.lr=5e-4 actor.warmup_ratio=0.1 actor.save_dir="$OUT/ppo" \
    rollout.env_path=envs/demo_vision.py rollout.max_turns=1 \
    "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 4}" \
    "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 4}" \
    adv.estimator=reinforce adv.norm_var=true \
    trainer.total_steps="$PPO_STEPS" trainer.test_freq=10 trainer.seed="$SEED" trainer.disable_wandb=true "$@"
echo "metrics: $OUT/ppo/metrics.jsonl, trajectories: $OUT/ppo/trajectories/"
