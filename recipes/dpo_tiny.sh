#!/usr/bin/env bash
# The CPU demo of DPO: a tiny random-init Qwen2 policy learns to prefer kind over unkind replies
# (recipes/make_pair_data.py) against a frozen copy of itself, on NPROC ranks; held-out accuracy is
# the share of test pairs (about unseen objects) whose implicit reward ranks the chosen reply first.
# Extra key=value arguments go to the trainer.
set -euo pipefail
OUT=${OUT:-outputs/dpo_tiny}
NPROC=${NPROC:-2}
STEPS=${STEPS:-32}
export WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || python -m rl2.testing.tiny "$OUT/model" --hidden-size 128 --layers 2
python recipes/make_pair_data.py "$OUT/data" --rows 512 --test-rows 64
rm -rf "$OUT/dpo"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.dpo \
    data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" data.batch_size=32 \
    actor.model_name="$OUT/model" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.lr=1e-3 actor.warmup_ratio=0.05 actor.max_length_per_device=1024 actor.beta=0.1 \
    actor.save_dir="$OUT/dpo" trainer.total_steps="$STEPS" trainer.test_freq=8 trainer.disable_wandb=true "$@"
python - "$OUT/dpo/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
tests = [r for r in rows if "test/accuracy" in r]
print("held-out accuracy: " + ", ".join(f"step {r['step']}: {r['test/accuracy']:.2f}" for r in tests))
print("held-out margin:   " + ", ".join(f"step {r['step']}: {r['test/margin']:.3f}" for r in tests))
print(f"train loss {rows[1]['loss']:.3f} -> {rows[-1]['loss']:.3f}; metrics in {sys.argv[1]}")
PY
