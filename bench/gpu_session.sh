#!/usr/bin/env bash
# What a session with a lent GPU runs, one stage per device call (each well inside the 10-minute limit),
# writing each stage's log to $OUT/<stage>.txt. The GPU machine has torch and an older transformers but
# no registry, so the packages rl2 needs there travel as wheels:
#
#   here:   bash bench/gpu_session.sh wheels        # into .whl/ (ignored by git), about 20 MB
#   there:  bash bench/gpu_session.sh checks        # device run, carry [".whl"]: bench/gpu_checks.py first
#           bash bench/gpu_session.sh rollout       # bench/gpu_rollout.py (issue 16's >= 4x target)
#           bash bench/gpu_session.sh train         # bench/gpu_train.py (issue 15's targets)
#           bash bench/gpu_session.sh demo          # the GRPO demo on one GPU, then the tool demo (DEMO_TASKS)
#           bash bench/gpu_session.sh split         # the GRPO demo one-step-off: 1 trainer + 1 rollout rank, one GPU
#           bash bench/gpu_session.sh vs_trl        # bench/vs_trl.py on the GPU: TRL's GRPOTrainer and rl2 at 0.5b, bf16
#
# Arguments after the stage go to its script (`train --shapes 0.5b --steps 2`); STAGE_TIMEOUT (seconds)
# bounds a stage (each demo half) so that several stages fit one call.
#
# Record what they print in bench/RESULTS.md with the date and device.
set -euo pipefail
STAGE=${1:?usage: bash bench/gpu_session.sh wheels|checks|rollout|train|demo|split|vs_trl [script arguments]}
shift
cd "$(dirname "$0")/.."

# Versions as on the CPU machines where the suite passes; pure-Python sdists are built into wheels here.
WHEELS="transformers==5.23.0 tokenizers==0.23.3 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 omegaconf==2.4.0
antlr4-python3-runtime==4.13.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 pylatexenc==2.11 bm25s==0.3.16
plotly==7.1.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==0.30.0 jsonschema-specifications==2025.9.1
trl==1.16.0"  # TRL for the vs_trl stage only (its other needs are in the GPU image)

if [ "$STAGE" = wheels ]; then
  mkdir -p .whl
  for package in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$package" 2>/dev/null || python3 -m pip wheel -q --no-deps -w .whl "$package"
  done
  ls -la .whl
  exit 0
fi

OUT=${OUT:-outputs/gpu_session}
mkdir -p "$OUT"
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no GPU") | tee "$OUT/$STAGE.txt"
case "$STAGE" in
  checks) timeout "${STAGE_TIMEOUT:-540}" python3 bench/gpu_checks.py "$@" 2>&1 | tee -a "$OUT/checks.txt" ;;
  rollout) timeout "${STAGE_TIMEOUT:-560}" python3 bench/gpu_rollout.py "$@" 2>&1 | tee -a "$OUT/rollout.txt" ;;
  train) timeout "${STAGE_TIMEOUT:-560}" python3 bench/gpu_train.py "$@" 2>&1 | tee -a "$OUT/train.txt" ;;
  demo)  # DEMO_TASKS picks the demos (default both)
    for task in ${DEMO_TASKS:-successor tools}; do
      (TASK=$task NPROC=1 OUT=/tmp/demo_$task timeout "${STAGE_TIMEOUT:-270}" bash recipes/ppo_tiny.sh "$@" 2>&1 \
          | tail -40) | tee -a "$OUT/demo.txt"
    done ;;
  split)  # one-step-off split placement on one GPU: the warm-up on one rank, then 1 trainer + 1 rollout rank
    (NPROC=1 PPO_STEPS=0 OUT=/tmp/split timeout "${STAGE_TIMEOUT:-270}" bash recipes/ppo_tiny.sh 2>&1 | tail -5
     NPROC=2 SFT_CKPT=/tmp/split/sft/step200 OUT=/tmp/split timeout "${STAGE_TIMEOUT:-270}" bash recipes/ppo_tiny.sh \
        rollout.placement=split rollout.ranks=1 rollout.max_staleness=1 "$@" 2>&1 | tail -40) | tee -a "$OUT/split.txt" ;;
  vs_trl) timeout "${STAGE_TIMEOUT:-560}" python3 bench/vs_trl.py --device cuda --sizes 0.5b --procs 1 --seeds 42 \
      --steps 20 --out /tmp/vs_trl "$@" 2>&1 | tee -a "$OUT/vs_trl.txt"
    for run in /tmp/vs_trl/*/rl2*; do cp "$run/metrics.jsonl" "$OUT/$(basename "$run").jsonl" 2>/dev/null || true; done ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
