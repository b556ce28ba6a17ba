#!/usr/bin/env bash
# The CPU demo of RL: a tiny random-init Qwen2 model, a short SFT warm-up, then GRPO on NPROC ranks.
#
#   TASK=successor (default)  "What number comes after 6?" rewarded only as \boxed{7}: the warm-up
#                             teaches the numbers but answers in that format 15% of the time; RL
#                             makes the policy use it every time.
#   TASK=lookup               multi-turn: the code of a box is known only to the env's lookup tool;
#                             the warm-up calls the tool half the time and guesses otherwise; RL
#                             learns that calling the tool pays (the tool through interact(messages)).
#   TASK=tools                native function calling: lookup(box) is a typed function in
#                             envs/demo_tools.py, shown to the model by its chat template (a compact
#                             ChatML with tools, rl2.testing.tiny --template chatml-tools), its calls
#                             parsed from <tool_call> JSON; the warm-up's rows carry tool_calls.
#
# Both stages warm the lr up: Adam's first steps move every weight by ~lr whatever its gradient, which
# at full lr once sent the warm-up into a long plateau (SFT seed 10) and the policy into an all-zero-
# reward state GRPO cannot leave (seed 42); bench/RESULTS.md has the seed sweep.
#
# Extra key=value arguments go to the PPO trainer. SFT_STEPS and PPO_STEPS shorten the run; SEED
# (default 42) seeds both stages (bench/demo_seeds.py runs the demo over many); SFT_CKPT=<folder> starts
# GRPO from an earlier warm-up's checkpoint instead of running one; PPO_STEPS=0 runs the warm-up alone.
set -euo pipefail
# The launcher: torchrun run by the PATH's python (a venv's too: make test-vllm), or TORCHRUN
TORCHRUN=${TORCHRUN:-python -m torch.distributed.run}
TASK=${TASK:-successor}
OUT=${OUT:-outputs/ppo_tiny_$TASK}
NPROC=${NPROC:-2}
PPO_STEPS=${PPO_STEPS:-60}
SEED=${SEED:-42}
case "$TASK" in
  successor) TURNS=1; NEW_TOKENS=12 ;;
  lookup) TURNS=2; NEW_TOKENS=16 ;;
  tools) TURNS=2; NEW_TOKENS=48; TEMPLATE=${TEMPLATE:-chatml-tools}; SFT_STEPS=${SFT_STEPS:-400} ;;
  *) echo "TASK must be successor, lookup or tools, not $TASK" >&2; exit 2 ;;
esac
TEMPLATE=${TEMPLATE:-chatml}
SFT_STEPS=${SFT_STEPS:-200}
export WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || python -m rl2.testing.tiny "$OUT/model" --hidden-size 128 --layers 2 --template "$TEMPLATE"
python recipes/make_demo_data.py --task "$TASK" --out "$OUT/data" --rows 4000

if [ -n "${SFT_CKPT:-}" ]; then
  START="$SFT_CKPT"
else
  START="$OUT/sft/step$SFT_STEPS"
  echo "== SFT warm-up ($SFT_STEPS steps)"
  rm -rf "$OUT/sft"
  $TORCHRUN --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft \
      data.path="$OUT/data/sft.jsonl" data.batch_size=64 \
      actor.model_name="$OUT/model" actor.dtype=float32 actor.gradient_checkpointing=false \
      actor.lr=3e-3 actor.warmup_ratio=0.2 actor.save_dir="$OUT/sft" \
      trainer.total_steps="$SFT_STEPS" trainer.seed="$SEED" trainer.disable_wandb=true
fi

if [ "$PPO_STEPS" = 0 ]; then  # the warm-up alone (tests share one per seed)
  echo "warm-up: $START"
  exit 0
fi
echo "== GRPO ($PPO_STEPS steps, env envs/demo_$TASK.py)"
rm -rf "$OUT/ppo"
$TORCHRUN --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo \
    data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
    data.prompts_per_rollout=16 data.responses_per_prompt=8 \
    actor.model_name="$START" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.lr=5e-4 actor.warmup_ratio=0.1 actor.save_dir="$OUT/ppo" \
    rollout.env_path="envs/demo_$TASK.py" rollout.max_turns="$TURNS" \
    "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: $NEW_TOKENS}" \
    "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: $NEW_TOKENS}" \
    adv.estimator=reinforce adv.norm_var=true \
    trainer.total_steps="$PPO_STEPS" trainer.test_freq=20 trainer.seed="$SEED" trainer.disable_wandb=true "$@"
echo "metrics: $OUT/ppo/metrics.jsonl, trajectories: $OUT/ppo/trajectories/"
echo "report: $OUT/ppo/report.html (open it in a browser: plots and the trajectories, offline)"
