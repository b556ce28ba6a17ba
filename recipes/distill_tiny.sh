#!/usr/bin/env bash
# The CPU demo of on-policy distillation, on recipes/ppo_tiny.sh's task ("What number comes after 6?",
# rewarded only as \boxed{7} by envs/demo_successor.py):
#
#   teacher  a tiny random-init Qwen2 (hidden 128, 2 layers), SFT-warmed on replies that are all \boxed{n}:
#            it answers correctly;
#   student  a smaller one (hidden 64, same tokenizer), SFT-warmed for fewer steps on the demo's usual
#            replies (\boxed{n} 15% of the time, "The answer is n." otherwise): reward ~0.06;
#   distil   the student samples, the teacher scores its tokens, the reverse KL trains it
#            (distill.mode=reward: -coef x (log p_student - log p_teacher) per token; with
#            adv.estimator=reinforce_plus_plus adv.gamma=0 each token's advantage is its own reward,
#            whitened: Thinking Machines' discount 0. GRPO's adv.estimator=reinforce, which sums the token
#            rewards into one score per answer, and adv.gamma=1 both favour short answers: here they cut
#            them to ~1.6 tokens.)
#
# The env reward is measured (reward/mean, test/reward_mean) but does not train unless ENV_REWARD=true:
# the student's reward rises on the teacher's signal alone. Extra key=value arguments go to the PPO
# trainer (e.g. distill.mode=loss). TEACHER_SFT_STEPS, STUDENT_SFT_STEPS, DISTILL_STEPS shorten the run;
# TEACHER=<folder> / STUDENT=<folder> skip a warm-up. bench/RESULTS.md has the numbers.
set -euo pipefail
OUT=${OUT:-outputs/distill_tiny}
NPROC=${NPROC:-2}
SEED=${SEED:-42}
TEACHER_SFT_STEPS=${TEACHER_SFT_STEPS:-300}
STUDENT_SFT_STEPS=${STUDENT_SFT_STEPS:-200}
DISTILL_STEPS=${DISTILL_STEPS:-60}
ENV_REWARD=${ENV_REWARD:-false}
export WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
python recipes/make_demo_data.py --task successor --out "$OUT/data" --rows 4000
python recipes/make_demo_data.py --task successor --out "$OUT/teacher_data" --rows 4000 --boxed-ratio 1.0

# sft NAME HIDDEN DATA STEPS: a tiny model of that width SFT-warmed on DATA; prints its checkpoint folder
sft() {
  local name=$1 hidden=$2 data=$3 steps=$4
  [ -f "$OUT/$name/model/config.json" ] || python -m rl2.testing.tiny "$OUT/$name/model" --hidden-size "$hidden" --layers 2 >&2
  echo "== $name: SFT warm-up ($steps steps, hidden $hidden)" >&2
  rm -rf "$OUT/$name/sft"
  python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft \
      data.path="$data" data.batch_size=64 \
      actor.model_name="$OUT/$name/model" actor.dtype=float32 actor.gradient_checkpointing=false \
      actor.lr=3e-3 actor.warmup_ratio=0.2 actor.save_dir="$OUT/$name/sft" \
      trainer.total_steps="$steps" trainer.seed="$SEED" trainer.disable_wandb=true >&2
  echo "$OUT/$name/sft/step$steps"
}
TEACHER=${TEACHER:-$(sft teacher 128 "$OUT/teacher_data/sft.jsonl" "$TEACHER_SFT_STEPS")}
STUDENT=${STUDENT:-$(sft student 64 "$OUT/data/sft.jsonl" "$STUDENT_SFT_STEPS")}

echo "== the teacher's test reward (greedy)"
rm -rf "$OUT/teacher_eval"
python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo \
    data.test_path="$OUT/data/test.jsonl" actor.model_name="$TEACHER" actor.dtype=float32 \
    actor.save_dir="$OUT/teacher_eval" rollout.env_path=envs/demo_successor.py \
    "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 12}" \
    trainer.eval_only=true trainer.seed="$SEED" trainer.disable_wandb=true

echo "== on-policy distillation ($DISTILL_STEPS steps, env reward trains: $ENV_REWARD)"
rm -rf "$OUT/distill"
python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo \
    data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
    data.prompts_per_rollout=16 data.responses_per_prompt=8 \
    actor.model_name="$STUDENT" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.lr=5e-4 actor.warmup_ratio=0.1 actor.save_dir="$OUT/distill" \
    teacher.model_name="$TEACHER" distill.coef=0.1 distill.mode=reward distill.env_reward="$ENV_REWARD" \
    rollout.env_path=envs/demo_successor.py \
    "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 12}" \
    "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 12}" \
    adv.estimator=reinforce_plus_plus adv.gamma=0 \
    trainer.total_steps="$DISTILL_STEPS" trainer.test_freq=10 trainer.seed="$SEED" trainer.disable_wandb=true "$@"
echo "metrics: $OUT/distill/metrics.jsonl (distill/reverse_kl, distill/teacher_logp, reward/mean, test/reward_mean)"
