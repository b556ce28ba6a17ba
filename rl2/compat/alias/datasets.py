"""RL2's `RL2.datasets` names an RL2 HEAD env file imports: rl2's versions of them (`rl2.compat.rl2_head_api`)."""

from rl2.compat.rl2_head_api import Sample, add_env_response, add_llm_response, base_generate, initialize_state_dict

__all__ = ["Sample", "add_env_response", "add_llm_response", "base_generate", "initialize_state_dict"]
