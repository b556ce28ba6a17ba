#!/usr/bin/env bash
# The CPU demo: SFT of a tiny random-init Qwen2 model on a small generated task, on NPROC ranks.
# Extra key=value arguments are passed to the trainer.
set -euo pipefail
OUT=${OUT:-outputs/sft_tiny}
NPROC=${NPROC:-2}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || python -m rl2.testing.tiny "$OUT/model" --hidden-size 128 --layers 2
python recipes/make_sft_data.py "$OUT/data.jsonl" --rows 512
rm -rf "$OUT/ckpt"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.sft \
    data.path="$OUT/data.jsonl" data.test_ratio=0.05 data.batch_size=32 \
    actor.model_name="$OUT/model" actor.dtype=float32 actor.gradient_checkpointing=false \
    actor.lr=3e-3 actor.warmup_ratio=0.05 actor.max_length_per_device=1024 \
    actor.save_dir="$OUT/ckpt" trainer.n_epochs=10 trainer.test_freq=20 trainer.disable_wandb=true "$@"
python - "$OUT/ckpt/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
tests = [r["test/loss"] for r in rows if "test/loss" in r]
print(f"train loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} over {len(rows)} steps; "
      f"test loss {tests[0]:.3f} -> {tests[-1]:.3f}; metrics in {sys.argv[1]}")
PY
