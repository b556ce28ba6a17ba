#!/usr/bin/env bash
# rStar2-Agent: GRPO-RoC with a Python tool, in stages (docs/guides/code-execution.md).
#
#   bash recipes/rstar2_agent/train.sh           # 8 GPUs: Qwen2.5-7B-Instruct, config.yaml
#   TINY=1 bash recipes/rstar2_agent/train.sh    # CPU: tiny model, shipped sample, tiny.yaml
#
# 1. data: prepare_data.py turns DAPO-Math-17k-style TRAIN_FILES and an AIME-style TEST_FILE into rows
# 2. stage 1: GRPO-RoC with responses up to STAGE1_TOKENS
# 3. stage 2: from stage 1's last checkpoint, responses up to STAGE2_TOKENS (skipped when STAGE2_STEPS=0)
# 4. difficulty filter: FILTER_SAMPLES answers per problem from the last checkpoint; problems it
#    always solves are dropped
# 5. stage 3: the filtered problems, responses up to STAGE3_TOKENS
# 6. evaluation: trainer.eval_only=true, avg@k / pass@k on the test file -> $OUT/eval/eval.json
#
# Programs run in rl2's local sandbox (EXECUTOR=sandbox) or on a code-judge service
# (EXECUTOR=code-judge: CODE_SERVER_URL, or rl2's built-in server started here). Each stage resumes
# from its latest checkpoint when the script is run again. Extra key=value arguments go to every
# training stage.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
# shellcheck source=recipes/lib.sh
source recipes/lib.sh
TINY=${TINY:-0}
EXECUTOR=${EXECUTOR:-sandbox}
export PYTHON_TOOL_MAX_CHARS=${PYTHON_TOOL_MAX_CHARS:-256}   # tool output shown to the model
export PYTHON_TOOL_TIMEOUT=${PYTHON_TOOL_TIMEOUT:-4}         # seconds per program
if [ "$TINY" = 1 ]; then
  CONFIG=recipes/rstar2_agent/tiny.yaml
  OUT=${OUT:-outputs/rstar2_agent_tiny}
  NPROC=${NPROC:-2}
  TRAIN_FILES=${TRAIN_FILES:-recipes/rstar2_agent/sample/dapo_math_17k.jsonl}
  TEST_FILE=${TEST_FILE:-recipes/rstar2_agent/sample/aime_test.jsonl}
  STAGE1_STEPS=${STAGE1_STEPS:-1}; STAGE1_TOKENS=${STAGE1_TOKENS:-80}
  STAGE2_STEPS=${STAGE2_STEPS:-0}; STAGE2_TOKENS=${STAGE2_TOKENS:-88}
  STAGE3_STEPS=${STAGE3_STEPS:-1}; STAGE3_TOKENS=${STAGE3_TOKENS:-96}
  FILTER_SAMPLES=${FILTER_SAMPLES:-2}
  PROMPT_TOKENS=${PROMPT_TOKENS:-768}  # the tool schema alone is ~600 tiny-tokenizer tokens
  export PYTHON_TOOL_WORKERS=${PYTHON_TOOL_WORKERS:-2} WANDB_MODE=${WANDB_MODE:-disabled}
  MODEL=$OUT/model
  [ -f "$MODEL/config.json" ] || python -m rl2.testing.tiny "$MODEL" --hidden-size 64 --layers 2
else
  CONFIG=recipes/rstar2_agent/config.yaml
  OUT=${OUT:-outputs/rstar2_agent}
  NPROC=${NPROC:-8}
  TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to DAPO-Math-17k file(s), e.g. dapo-math-17k.parquet}
  TEST_FILE=${TEST_FILE:?set TEST_FILE to an AIME-style file of {problem, answer} rows}
  STAGE1_STEPS=${STAGE1_STEPS:-300}; STAGE1_TOKENS=${STAGE1_TOKENS:-8192}
  STAGE2_STEPS=${STAGE2_STEPS:-200}; STAGE2_TOKENS=${STAGE2_TOKENS:-12288}
  STAGE3_STEPS=${STAGE3_STEPS:-100}; STAGE3_TOKENS=${STAGE3_TOKENS:-12288}
  FILTER_SAMPLES=${FILTER_SAMPLES:-8}
  PROMPT_TOKENS=${PROMPT_TOKENS:-2048}
  MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
fi
mkdir -p "$OUT/data"

if [ "$EXECUTOR" = code-judge ] && [ -z "${CODE_SERVER_URL:-}" ]; then
  start_service "code server" "$OUT/code_server.log" "code service ready at" \
    python -m rl2.tools.code_server --host 127.0.0.1 --port 0 --timeout "$PYTHON_TOOL_TIMEOUT"
  export CODE_SERVER_URL=$SERVICE_URL
  echo "== code-judge service at $CODE_SERVER_URL"
elif [ "$EXECUTOR" != code-judge ] && [ "$EXECUTOR" != sandbox ]; then
  echo "EXECUTOR must be sandbox or code-judge, not $EXECUTOR" >&2; exit 2
fi

echo "== data"
# shellcheck disable=SC2086  # TRAIN_FILES may list several files
python recipes/rstar2_agent/prepare_data.py $(printf -- '--input %s ' $TRAIN_FILES) --output "$OUT/data/train.jsonl"
python recipes/rstar2_agent/prepare_data.py --input "$TEST_FILE" --output "$OUT/data/test.jsonl"

if [ "$TINY" = 1 ]; then tiny_warmup python; fi

# run_stage NAME DATA STEPS RESPONSE_TOKENS [key=value ...]: one GRPO-RoC stage from $MODEL; then
# MODEL is its last checkpoint
run_stage() {
  local name=$1 data=$2 steps=$3 tokens=$4
  shift 4
  echo "== $name: $steps steps, responses up to $tokens tokens, from $MODEL"
  torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" \
    actor.model_name="$MODEL" data.path="$data" data.test_path="$OUT/data/test.jsonl" \
    data.max_length=$((PROMPT_TOKENS + tokens)) \
    "rollout.train_sampling_params.max_new_tokens=$tokens" "rollout.test_sampling_params.max_new_tokens=$tokens" \
    actor.save_dir="$OUT/$name" trainer.total_steps="$steps" trainer.experiment_name="rstar2_agent_$name" "$@"
  MODEL=$OUT/$name/step$steps
}

run_stage stage1 "$OUT/data/train.jsonl" "$STAGE1_STEPS" "$STAGE1_TOKENS" "$@"
if [ "$STAGE2_STEPS" -gt 0 ]; then
  run_stage stage2 "$OUT/data/train.jsonl" "$STAGE2_STEPS" "$STAGE2_TOKENS" "$@"
fi

echo "== difficulty filter: $FILTER_SAMPLES answers per problem from $MODEL"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.difficulty_filter config="$CONFIG" \
  actor.model_name="$MODEL" data.path="$OUT/data/train.jsonl" data.max_length=$((PROMPT_TOKENS + STAGE3_TOKENS)) \
  "rollout.train_sampling_params.max_new_tokens=$STAGE3_TOKENS" \
  filter.responses_per_prompt="$FILTER_SAMPLES" filter.output="$OUT/data/train_hard.jsonl"
if [ ! -s "$OUT/data/train_hard.jsonl" ]; then
  echo "the difficulty filter kept no problems (see $OUT/data/train_hard.jsonl.pass_rates.jsonl); stopping" >&2
  exit 1
fi

run_stage stage3 "$OUT/data/train_hard.jsonl" "$STAGE3_STEPS" "$STAGE3_TOKENS" "$@"

echo "== evaluation of $MODEL"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" trainer.eval_only=true \
  actor.model_name="$MODEL" data.test_path="$OUT/data/test.jsonl" data.max_length=$((PROMPT_TOKENS + STAGE3_TOKENS)) \
  "rollout.test_sampling_params.max_new_tokens=$STAGE3_TOKENS" trainer.load_ckpt_from=null actor.save_dir="$OUT/eval"
echo "results: $OUT/eval/eval.json; trajectories: $OUT/stage*/trajectories/"
