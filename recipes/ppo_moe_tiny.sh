#!/usr/bin/env bash
# The CPU demo of mixture-of-experts RL (make demo-moe): the GRPO demo's successor task (recipes/ppo_tiny.sh) on a
# tiny random-init Qwen3-MoE (rl2.testing.tiny_moe: 2 layers, hidden 128, 8 experts, top-2), a short SFT warm-up,
# then GRPO on NPROC ranks.
#
# ROUTER_REPLAY (off | r2 | r3; default r2) is actor.router_replay: r2 replays in the update the experts the
# old-log-prob forward chose; r3 the experts the rollout engine chose (it stops with an error while the engine
# records none). Two updates per rollout (actor.update_per_rollout=2): the second minibatch's forward runs after
# the first update moved the routers, so replay changes something (with one, r2's recorded experts are the ones
# the update's own forward would choose). Besides the rewards the run logs router/mismatch (with replay) and
# router/load_max (how unevenly each layer spreads its tokens over its experts; docs/reference/metrics.md).
# bench/demo_moe.py runs it for each ROUTER_REPLAY; bench/RESULTS.md has the figures.
#
# Extra key=value arguments go to the PPO trainer; SFT_STEPS, PPO_STEPS, SEED, SFT_CKPT and PPO_STEPS=0 work as
# in recipes/ppo_tiny.sh.
set -euo pipefail
TORCHRUN=${TORCHRUN:-python -m torch.distributed.run}
OUT=${OUT:-outputs/ppo_moe_tiny}
NPROC=${NPROC:-2}
SFT_STEPS=${SFT_STEPS:-200}
PPO_STEPS=${PPO_STEPS:-30}
SEED=${SEED:-42}
ROUTER_REPLAY=${ROUTER_REPLAY:-r2}
case "$ROUTER_REPLAY" in
  off|r2|r3) ;;
  *) echo "ROUTER_REPLAY must be off, r2 or r3, not $ROUTER_REPLAY" >&2; exit 2 ;;
esac
export WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || python -m rl2.testing.tiny_moe "$OUT/model" --family qwen3_moe --hidden-size 128 --layers 2
python recipes/make_demo_data.py --task successor --out "$OUT/data" --rows 4000

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

if [ "$PPO_STEPS" = 0 ]; then
  echo "warm-up: $START"
  exit 0
fi
echo "== GRPO ($PPO_STEPS steps, env envs/demo_successor.py, actor.router_replay=$ROUTER_REPLAY)"
rm -rf "$OUT/ppo"
$TORCHRUN --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo \
    data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
    data.prompts_per_rollout=16 data.responses_per_prompt=8 \
    actor.model_name="$START" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.lr=5e-4 actor.warmup_ratio=0.1 actor.save_dir="$OUT/ppo" \
    actor.router_replay="$ROUTER_REPLAY" actor.update_per_rollout=2 \
    rollout.env_path=envs/demo_successor.py \
    "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 12}" \
    "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 12}" \
    adv.estimator=reinforce adv.norm_var=true \
    trainer.total_steps="$PPO_STEPS" trainer.test_freq=10 trainer.seed="$SEED" trainer.disable_wandb=true "$@"
echo "metrics: $OUT/ppo/metrics.jsonl, trajectories: $OUT/ppo/trajectories/"
