#!/usr/bin/env bash
# The CPU demo of reward modelling: a tiny random-init Qwen2 model learns which of two replies is
# preferred (kind vs unkind adjectives, recipes/make_pair_data.py) on NPROC ranks, is tested on
# pairs about unseen objects, then scores text through the env file envs/reward_model.py.
# Extra key=value arguments go to the trainer.
set -euo pipefail
OUT=${OUT:-outputs/rm_tiny}
NPROC=${NPROC:-2}
STEPS=${STEPS:-32}
export WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || python -m rl2.testing.tiny "$OUT/model" --hidden-size 128 --layers 2
python recipes/make_pair_data.py "$OUT/data" --rows 512 --test-rows 64
rm -rf "$OUT/rm"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.rm \
    data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" data.batch_size=32 \
    critic.model_name="$OUT/model" critic.dtype=float32 critic.gradient_checkpointing=false \
    critic.lr=3e-4 critic.warmup_ratio=0.05 critic.max_length_per_device=1024 \
    critic.save_dir="$OUT/rm" trainer.total_steps="$STEPS" trainer.test_freq=8 trainer.disable_wandb=true "$@"
RL2_REWARD_MODEL="$OUT/rm/step$STEPS" RL2_REWARD_DEVICE=cpu python - "$OUT/rm/metrics.jsonl" <<'PY'
import json, sys
from rl2 import Env
rows = [json.loads(line) for line in open(sys.argv[1])]
tests = [(r["step"], r["test/accuracy"]) for r in rows if "test/accuracy" in r]
print("held-out accuracy: " + ", ".join(f"step {s}: {a:.2f}" for s, a in tests))
prompt = [{"role": "user", "content": "Tell me about the lighthouse."}]
replies = ["The lighthouse is warm and gentle.", "The lighthouse is grim and broken."]
with Env("envs/reward_model.py") as env:
    results = env.rewards([prompt + [{"role": "assistant", "content": r}] for r in replies], [None, None])
for reply, result in zip(replies, results):
    print(f"reward_fn via envs/reward_model.py: {result.value:+.3f}  {reply!r}")
PY
