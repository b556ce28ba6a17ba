#!/usr/bin/env bash
# Search-R1: GRPO with a search engine (docs/guides/search.md).
#
#   CORPUS=wiki-18.jsonl TRAIN_FILES="nq_train.jsonl hotpotqa_train.jsonl" TEST_FILES="nq_test.jsonl" \
#     bash recipes/search_r1/train.sh          # 8 GPUs: Qwen2.5-3B-Instruct, config.yaml
#   TINY=1 bash recipes/search_r1/train.sh     # CPU: tiny model, shipped corpus and questions, tiny.yaml
#
# 1. data: prepare_data.py turns NQ / HotpotQA-style files into rows with Search-R1's prompt
# 2. retrieval: rl2's retrieval server on CORPUS ({"id", "contents": "title\ntext"} lines; BM25, or
#    RETRIEVER=dense with ENCODER=<local e5 folder>), on loopback, unless SEARCH_URL is given
# 3. GRPO (5 responses per prompt, KL loss 0.001, up to 4 turns), resuming from its latest checkpoint
# 4. evaluation: trainer.eval_only=true on the test rows -> $OUT/eval/eval.json
# Extra key=value arguments go to the training run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
# shellcheck source=recipes/lib.sh
source recipes/lib.sh
TINY=${TINY:-0}
if [ "$TINY" = 1 ]; then
  CONFIG=recipes/search_r1/tiny.yaml
  OUT=${OUT:-outputs/search_r1_tiny}
  NPROC=${NPROC:-1}
  CORPUS=${CORPUS:-recipes/data/search_corpus.jsonl}
  TRAIN_FILES=${TRAIN_FILES:-recipes/search_r1/sample/nq_train.jsonl}
  TEST_FILES=${TEST_FILES:-recipes/search_r1/sample/hotpotqa_dev.jsonl}
  STEPS=${STEPS:-2}
  export WANDB_MODE=${WANDB_MODE:-disabled}
  MODEL=$OUT/model
  [ -f "$MODEL/config.json" ] || python -m rl2.testing.tiny "$MODEL" --hidden-size 64 --layers 2
else
  CONFIG=recipes/search_r1/config.yaml
  OUT=${OUT:-outputs/search_r1}
  NPROC=${NPROC:-8}
  CORPUS=${CORPUS:?set CORPUS to a JSON lines corpus, e.g. Search-R1s wiki-18.jsonl}
  TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to NQ / HotpotQA-style training files}
  TEST_FILES=${TEST_FILES:?set TEST_FILES to NQ / HotpotQA-style test files}
  STEPS=${STEPS:-1005}
  MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
fi
mkdir -p "$OUT/data"

echo "== data"
# shellcheck disable=SC2086  # the file lists may hold several files
python recipes/search_r1/prepare_data.py $(printf -- '--input %s ' $TRAIN_FILES) --output "$OUT/data/train.jsonl"
# shellcheck disable=SC2086
python recipes/search_r1/prepare_data.py $(printf -- '--input %s ' $TEST_FILES) --output "$OUT/data/test.jsonl"

if [ -z "${SEARCH_URL:-}" ]; then
  RETRIEVER_ARGS=(--retriever "${RETRIEVER:-bm25}")
  [ -n "${ENCODER:-}" ] && RETRIEVER_ARGS+=(--encoder "$ENCODER")
  start_service "retrieval server" "$OUT/retrieval_server.log" "retrieval server ready on" \
    python -m rl2.tools.retrieval_server --corpus "$CORPUS" --host 127.0.0.1 --port 0 "${RETRIEVER_ARGS[@]}"
  export SEARCH_URL=$SERVICE_URL/retrieve
fi
echo "== retrieval at $SEARCH_URL"

if [ "$TINY" = 1 ]; then tiny_warmup search; fi

echo "== GRPO: $STEPS steps from $MODEL"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" \
  actor.model_name="$MODEL" data.path="$OUT/data/train.jsonl" data.test_path="$OUT/data/test.jsonl" \
  actor.save_dir="$OUT/grpo" trainer.total_steps="$STEPS" "$@"

echo "== evaluation of $OUT/grpo/step$STEPS"
torchrun --standalone --nproc_per_node="$NPROC" -m rl2.trainer.ppo config="$CONFIG" trainer.eval_only=true \
  actor.model_name="$OUT/grpo/step$STEPS" data.test_path="$OUT/data/test.jsonl" \
  trainer.load_ckpt_from=null actor.save_dir="$OUT/eval"
echo "results: $OUT/eval/eval.json; trajectories: $OUT/grpo/trajectories/"
