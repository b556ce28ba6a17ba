"""Env file for an OpenEnv environment server (openenv-core): each trajectory an episode on the server at
`rollout.env_args.openenv_url`, the model's replies its actions, its observations the user turns, the sum of
its step rewards the trajectory's reward (`rl2.rollout.openenv`).

    torchrun -m rl2.trainer.ppo rollout.env_path=envs/openenv.py rollout.max_turns=8 \
        'rollout.env_args={openenv_url: http://127.0.0.1:8000, action_field: message, observation_field: prompt}'

env_args: openenv_url (required), action_field (the action's text field, default "message"), observation_field
(the observation's text field; default: its only text field), observation_role (user, or tool: the
observation comes as a tool message), reset_fields (row columns passed to the server's
reset), openenv_timeout (seconds a call may take, default 60).
"""

from rl2.rollout.openenv import OpenEnvClient

if not env_args.get("openenv_url"):
    raise ValueError("envs/openenv.py plays on an OpenEnv server: give its URL as rollout.env_args.openenv_url "
                     "(or OPENENV_URL)")
make_env = OpenEnvClient(
    env_args.get("openenv_url"),
    action_field=env_args.get("action_field", "message"),
    observation_field=env_args.get("observation_field"),
    reset_fields=env_args.get("reset_fields", ()),
    timeout=float(env_args.get("openenv_timeout", 60)),
    observation_role=env_args.get("observation_role", "user"),
)
