#!/usr/bin/env bash
# The multi-turn demo (TASK=lookup of recipes/ppo_tiny.sh) played on an OpenEnv server: the game of
# envs/demo_lookup_gym.py served by openenv-core (lookup_server.py), rl2 a client of it through envs/openenv.py,
# one session per trajectory. Needs `pip install -e ".[envs]"`. Extra arguments go to the trainer.
#   bash recipes/openenv_demo/run.sh            OUT=... NPROC=... PORT=... SFT_CKPT=... as for ppo_tiny.sh
set -euo pipefail
PORT=${PORT:-8765}
python recipes/openenv_demo/lookup_server.py --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null && break
  sleep 0.2
done
TASK=lookup OUT=${OUT:-outputs/openenv_demo} bash recipes/ppo_tiny.sh rollout.env_path=envs/openenv.py \
  "rollout.env_args={openenv_url: http://127.0.0.1:$PORT, action_field: message, observation_field: output, observation_role: tool, reset_fields: [messages, answer]}" \
  "$@"
