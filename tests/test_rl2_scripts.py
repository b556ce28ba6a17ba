"""RL2's own command lines parse, and each argument lands in the rl2 key it means.

The scripts below are the arguments of RL2's example scripts (github.com/ChenmienTan/RL2,
examples/*.sh) at HEAD (9161ede), at Nov-Dec 2025's layout (1fce214: train_data.sampling_params, ...) and at
two mid-2025 commits (27b288e, 8166bc9), typed out from those scripts: they are RL2's interface, the command lines its users have. Where each
argument must land is written out by hand in LANDS_IN, not read from rl2's alias table.
"""

import json

import pytest
import yaml

from conftest import run_python
from docs_blocks import blocks_marked
from rl2.config import ConfigError, config_help, load_config
from rl2.config.rl2_keys import RL2_KEYS
from rl2.metrics import read_metrics

SCRIPTS = {
    "9161ede/countdown_reinforce.sh": [
        "rollout.train.path=train@Chenmien/Countdown", "rollout.train.prompts_per_rollout=128",
        "rollout.train.responses_per_prompt=4", "rollout.train.sampling_params.max_new_tokens=1024",
        "rollout.train.sampling_params.stop=['</answer>']", "rollout.train.apply_chat_template=false",
        "rollout.test.path=test@Chenmien/Countdown", "rollout.env_path=envs/countdown.py",
        "actor.model_name=Qwen/Qwen2.5-3B-Instruct", "actor.max_length_per_device=8192", "trainer.project=Countdown",
        "trainer.experiment_name=qwen2.5-3b_reinforce", "trainer.total_steps=512", "trainer.test_freq=8",
        "trainer.save_freq=32",
    ],
    "9161ede/deepresearch_eval.sh": [
        "rollout.server_args.model_path=Alibaba-NLP/Tongyi-DeepResearch-30B-A3B", "rollout.server_args.tp_size=4",
        "rollout.train.path=Chenmien/EmptyDataset", "rollout.test.path=data/browsecomp.jsonl",
        "rollout.test.prompts_per_rollout=32", "rollout.test.sampling_params.temperature=0.7",
        "rollout.test.sampling_params.max_new_tokens=2048", "rollout.env_path=envs/deep_research.py",
        "trainer.eval_only=true", "trainer.use_wandb=false",
    ],
    "9161ede/gem_reinforce.sh": [
        "rollout.train.path=Chenmien/EmptyDataset", "rollout.train.prompts_per_rollout=64",
        "rollout.train.sampling_params.max_new_tokens=1024", "rollout.test.path=Chenmien/EmptyDataset",
        "rollout.test.prompts_per_rollout=64", "rollout.env_path=envs/gem.py", "actor.model_name=Qwen/Qwen3-1.7B-Base",
        "actor.max_length_per_device=8192", "adv.norm_var=true", "trainer.project=GEM",
        "trainer.experiment_name=letter-counting_qwen3-1.7b_reinforce", "trainer.total_steps=512", "trainer.save_freq=64",
    ],
    "9161ede/limo_sft.sh": [
        "data.train.path=Chenmien/LIMO", "data.train.max_length=16384", "data.train.batch_size=32",
        "actor.model_name=Qwen/Qwen2.5-7B-Instruct", "actor.cp_size=4", "actor.max_length_per_device=4096",
        "trainer.project=LIMO", "trainer.experiment_name=qwen2.5-7b-inst", "trainer.n_epochs=15",
    ],
    "9161ede/orz_ppo.sh": [
        "rollout.train.path=Chenmien/OpenReasonerZero", "rollout.train.prompts_per_rollout=128",
        "rollout.train.responses_per_prompt=64", "rollout.train.sampling_params.max_new_tokens=8192",
        "rollout.test.path=Chenmien/OlympiadBench", "rollout.env_path=envs/orz.py", "actor.model_name=Qwen/Qwen2.5-7B",
        "actor.cp_size=2", "actor.max_length_per_device=8192", "actor.freeze_steps=4", "critic.model_name=Qwen/Qwen2.5-7B",
        "critic.cp_size=2", "critic.max_length_per_device=8192", "adv.estimator=gae", "trainer.project=OpenReasonerZero",
        "trainer.experiment_name=qwen2.5-7b-ppo", "trainer.total_steps=512", "trainer.test_freq=8", "trainer.save_freq=32",
    ],
    "9161ede/orz_reinforce.sh": [
        "rollout.train.path=Chenmien/OpenReasonerZero", "rollout.train.prompts_per_rollout=128",
        "rollout.train.responses_per_prompt=64", "rollout.train.sampling_params.max_new_tokens=8192",
        "rollout.test.path=Chenmien/OlympiadBench", "rollout.env_path=envs/orz.py", "actor.model_name=Qwen/Qwen2.5-7B",
        "actor.cp_size=2", "actor.max_length_per_device=8192", "adv.estimator=reinforce",
        "trainer.project=OpenReasonerZero", "trainer.experiment_name=qwen2.5-7b-reinforce", "trainer.total_steps=512",
        "trainer.test_freq=8", "trainer.save_freq=32",
    ],
    # RL2's own script sets rollout.train.path twice (the second was meant for the test set): the last holds.
    "9161ede/searchr1.sh": [
        "rollout.train.path=train@Chenmien/SearchR1", "rollout.train.prompts_per_rollout=256",
        "rollout.train.responses_per_prompt=5", "rollout.train.max_turns=2",
        "rollout.train.sampling_params.max_new_tokens=512", "rollout.train.sampling_params.stop=['</search>','</answer>']",
        "rollout.train.path=test@Chenmien/SearchR1", "rollout.env_path=envs/searchr1.py", "actor.model_name=Qwen/Qwen2.5-3B",
        "actor.max_length_per_device=8192", "trainer.project=SearchR1", "trainer.experiment_name=qwen2.5-3b_reinforce",
        "trainer.total_steps=256", "trainer.test_freq=8",
    ],
    "9161ede/skywork_rm.sh": [
        "data.train.path=Chenmien/SkyworkRM", "data.train.max_length=2048",
        "critic.model_name=meta-llama/Llama-3.1-8B-Instruct", "critic.max_length_per_device=8192",
        "trainer.project=SkyworkRM", "trainer.experiment_name=llama-3.1-8b-inst",
    ],
    "9161ede/ultrafeedback_dpo.sh": [
        "data.train.path=Chenmien/UltraFeedback", "data.train.max_length=1024",
        "actor.model_name=allenai/Llama-3.1-Tulu-3-8B-SFT", "actor.max_length_per_device=4096",
        "trainer.project=UltraFeedback", "trainer.experiment_name=tulu-3-8b",
    ],
    # Nov-Dec 2025 (1fce214; 209d390 moved prompts_per_rollout into train_data / test_data).
    "1fce214/countdown_reinforce.sh": [
        "train_data.path=train@Chenmien/Countdown", "train_data.prompts_per_rollout=128",
        "train_data.responses_per_prompt=4", "train_data.sampling_params.max_new_tokens=1024",
        "train_data.sampling_params.stop=['</answer>']", "train_data.apply_chat_template=false",
        "test_data.path=test@Chenmien/Countdown", "actor.model_name=Qwen/Qwen2.5-3B-Instruct",
        "actor.max_length_per_device=8192", "rollout.env_path=envs/countdown.py", "trainer.project=Countdown",
        "trainer.experiment_name=qwen2.5-3b_reinforce", "trainer.total_steps=512", "trainer.test_freq=8",
        "trainer.save_freq=32",
    ],
    "1fce214/gem_reinforce.sh": [
        "train_data.sampling_params.max_new_tokens=1024", "train_data.prompts_per_rollout=64",
        "test_data.prompts_per_rollout=64", "actor.model_name=Qwen/Qwen3-1.7B-Base", "actor.max_length_per_device=8192",
        "rollout.env_path=envs/gem.py", "adv.norm_var=true", "trainer.project=GEM",
        "trainer.experiment_name=letter-counting_qwen3-1.7b_reinforce", "trainer.total_steps=512", "trainer.save_freq=64",
    ],
    "1fce214/limo_sft.sh": [
        "data.path=Chenmien/LIMO", "data.max_length=16384", "data.batch_size=32", "actor.model_name=Qwen/Qwen2.5-7B-Instruct",
        "actor.cp_size=4", "actor.max_length_per_device=4096", "trainer.project=LIMO",
        "trainer.experiment_name=qwen2.5-7b-inst", "trainer.n_epochs=15",
    ],
    "1fce214/orz_ppo.sh": [
        "train_data.path=Chenmien/OpenReasonerZero", "train_data.prompts_per_rollout=128",
        "train_data.responses_per_prompt=64", "train_data.sampling_params.max_new_tokens=8192",
        "test_data.path=Chenmien/OlympiadBench", "actor.model_name=Qwen/Qwen2.5-7B", "actor.cp_size=2",
        "actor.max_length_per_device=8192", "actor.freeze_steps=4", "critic.model_name=Qwen/Qwen2.5-7B",
        "critic.cp_size=2", "critic.max_length_per_device=8192", "rollout.env_path=envs/orz.py", "adv.estimator=gae",
        "trainer.project=OpenReasonerZero", "trainer.experiment_name=qwen2.5-7b-ppo", "trainer.total_steps=512",
        "trainer.test_freq=8", "trainer.save_freq=32",
    ],
    "1fce214/orz_reinforce.sh": [
        "train_data.path=Chenmien/OpenReasonerZero", "train_data.prompts_per_rollout=128",
        "train_data.responses_per_prompt=64", "train_data.sampling_params.max_new_tokens=8192",
        "test_data.path=Chenmien/OlympiadBench", "actor.model_name=Qwen/Qwen2.5-7B", "actor.cp_size=2",
        "actor.max_length_per_device=8192", "rollout.env_path=envs/orz.py", "adv.estimator=reinforce",
        "trainer.project=OpenReasonerZero", "trainer.experiment_name=qwen2.5-7b-reinforce", "trainer.total_steps=512",
        "trainer.test_freq=8", "trainer.save_freq=32",
    ],
    "1fce214/searchr1.sh": [
        "train_data.path=train@Chenmien/SearchR1", "train_data.prompts_per_rollout=256",
        "train_data.responses_per_prompt=5", "train_data.max_turns=2", "train_data.sampling_params.max_new_tokens=512",
        "train_data.sampling_params.stop=['</search>','</answer>']", "test_data.path=test@Chenmien/SearchR1",
        "actor.model_name=Qwen/Qwen2.5-3B", "actor.max_length_per_device=8192", "rollout.env_path=envs/searchr1.py",
        "trainer.project=SearchR1", "trainer.experiment_name=qwen2.5-3b_reinforce", "trainer.total_steps=256",
        "trainer.test_freq=8",
    ],
    "1fce214/skywork_rm.sh": [
        "data.path=Chenmien/SkyworkRM", "data.max_length=2048", "critic.model_name=meta-llama/Llama-3.1-8B-Instruct",
        "critic.max_length_per_device=8192", "trainer.project=SkyworkRM", "trainer.experiment_name=llama-3.1-8b-inst",
    ],
    "1fce214/ultrafeedback_dpo.sh": [
        "data.path=Chenmien/UltraFeedback", "data.max_length=1024", "actor.model_name=allenai/Llama-3.1-Tulu-3-8B-SFT",
        "actor.max_length_per_device=4096", "trainer.project=UltraFeedback", "trainer.experiment_name=tulu-3-8b",
    ],
    "27b288e/limo_sft.sh": [
        "data.path=Chenmien/LIMO", "data.max_length=16384", "data.batch_size=32", "actor.model_name=Qwen/Qwen2.5-7B-Instruct",
        "actor.sp_size=4", "actor.max_length_per_device=4096", "trainer.project=LIMO",
        "trainer.experiment_name=qwen2.5-7b-inst", "trainer.n_epochs=15",
    ],
    "27b288e/orz_ppo.sh": [
        "train_data.path=Chenmien/OpenReasonerZero", "train_data.prompts_per_rollout=128",
        "train_data.responses_per_prompt=64", "test_data.path=Chenmien/OlympiadBench", "actor.model_name=Qwen/Qwen2.5-7B",
        "actor.sp_size=2", "actor.max_length_per_device=8192", "actor.freeze_steps=4",
        "rollout.train_sampling_params.max_new_tokens=8192", "rollout.env_path=envs/orz.py", "adv.estimator=gae",
        "trainer.project=OpenReasonerZero", "trainer.experiment_name=qwen2.5-7b-ppo", "trainer.test_freq=8",
        "trainer.save_freq=32",
    ],
    "27b288e/orz_reinforce.sh": [
        "train_data.path=Chenmien/OpenReasonerZero", "train_data.prompts_per_rollout=128",
        "train_data.responses_per_prompt=64", "test_data.path=Chenmien/OlympiadBench", "actor.model_name=Qwen/Qwen2.5-7B",
        "actor.sp_size=2", "actor.max_length_per_device=8192", "rollout.train_sampling_params.max_new_tokens=8192",
        "rollout.env_path=envs/orz.py", "adv.estimator=reinforce", "trainer.project=OpenReasonerZero",
        "trainer.experiment_name=qwen2.5-7b-reinforce", "trainer.test_freq=8", "trainer.save_freq=32",
    ],
    "27b288e/searchr1.sh": [
        "data.train_data_path=train@Chenmien/SearchR1", "data.test_data_path=test@Chenmien/SearchR1",
        "data.prompts_per_rollout=256", "data.responses_per_prompt=8", "actor.model_name=Qwen/Qwen2.5-3B-Instruct",
        "actor.max_length_per_device=8192", "rollout.max_turns=4", "rollout.train_sampling_params.max_new_tokens=512",
        "rollout.env_path=envs/searchr1.py", "adv.estimator=reinforce", "trainer.project=SearchR1",
        "trainer.experiment_name=qwen2.5-3b-inst_reinforce", "trainer.test_freq=8",
    ],
    "27b288e/skywork_rm.sh": [
        "data.path=Chenmien/SkyworkRM", "data.max_length=2048", "critic.model_name=meta-llama/Llama-3.1-8B-Instruct",
        "critic.max_length_per_device=8192", "trainer.project=SkyworkRM", "trainer.experiment_name=llama-3.1-8b-inst",
    ],
    "27b288e/ultrafeedback_dpo.sh": [
        "data.path=Chenmien/UltraFeedback", "data.max_length=1024", "actor.model_name=allenai/Llama-3.1-Tulu-3-8B-SFT",
        "actor.max_length_per_device=4096", "trainer.project=UltraFeedback", "trainer.experiment_name=tulu-3-8b",
    ],
    "8166bc9/limo_sft.sh": [
        "data.path=Chenmien/LIMO", "data.max_length=16384", "data.batch_size=32", "actor.model_name=Qwen/Qwen2.5-7B-Instruct",
        "actor.sp_size=2", "actor.max_length_per_device=8192", "trainer.project=LIMO",
        "trainer.experiment_name=qwen2.5-7b-inst", "trainer.n_epochs=15",
    ],
    "8166bc9/orz_ppo.sh": [
        "data.train_data_path=Chenmien/OpenReasonerZero", "data.test_data_path=Chenmien/OlympiadBench",
        "data.prompts_per_rollout=128", "data.responses_per_prompt=64", "actor.model_name=Qwen/Qwen2.5-7B",
        "actor.sp_size=2", "actor.max_length_per_device=8192", "actor.freeze_steps=4", "actor.save_freq=32",
        "rollout.train_sampling_params.max_new_tokens=8192", "rollout.env_path=envs/orz.py", "adv.estimator=gae",
        "trainer.project=OpenReasonerZero", "trainer.experiment_name=qwen2.5-7b-ppo", "trainer.test_freq=8",
    ],
    "8166bc9/orz_reinforce.sh": [
        "data.train_data_path=Chenmien/OpenReasonerZero", "data.test_data_path=Chenmien/OlympiadBench",
        "data.prompts_per_rollout=128", "data.responses_per_prompt=64", "actor.model_name=Qwen/Qwen2.5-7B",
        "actor.max_length_per_device=16384", "actor.save_freq=32", "rollout.train_sampling_params.max_new_tokens=8192",
        "rollout.env_path=envs/orz.py", "adv.estimator=reinforce", "trainer.project=OpenReasonerZero",
        "trainer.experiment_name=qwen2.5-7b-reinforce", "trainer.test_freq=8",
    ],
    "8166bc9/searchr1.sh": [
        "data.train_data_path=train@Chenmien/SearchR1", "data.test_data_path=test@Chenmien/SearchR1",
        "data.prompts_per_rollout=256", "data.responses_per_prompt=8", "actor.model_name=Qwen/Qwen2.5-3B-Instruct",
        "actor.max_length_per_device=8192", "rollout.max_turns=4", "rollout.train_sampling_params.max_new_tokens=512",
        "rollout.env_path=envs/searchr1.py", "adv.estimator=reinforce", "trainer.project=SearchR1",
        "trainer.experiment_name=qwen2.5-3b-inst_reinforce", "trainer.test_freq=8",
    ],
    "8166bc9/skywork_rm.sh": [
        "data.path=Chenmien/SkyworkRM", "data.max_length=2048", "critic.model_name=meta-llama/Llama-3.1-8B-Instruct",
        "critic.max_length_per_device=8192", "trainer.project=SkyworkRM", "trainer.experiment_name=llama-3.1-8b-inst",
    ],
    "8166bc9/ultrafeedback_dpo.sh": [
        "data.path=Chenmien/UltraFeedback", "data.max_length=1024", "actor.model_name=allenai/Llama-3.1-Tulu-3-8B-SFT",
        "actor.max_length_per_device=8192", "trainer.project=UltraFeedback", "trainer.experiment_name=tulu-3-8b",
    ],
}

# RL2's key -> the rl2 keys its value must land in (test sampling inherits the training values it does
# not set; the tokenizer follows the model); () = accepted with no effect; "not ..." = the inverse.
TRAIN_AND_TEST = "rollout.train_sampling_params.{0}", "rollout.test_sampling_params.{0}"
LANDS_IN = {
    "rollout.train.path": ["data.path"],
    "rollout.train.prompts_per_rollout": ["data.prompts_per_rollout"],
    "rollout.train.responses_per_prompt": ["data.responses_per_prompt"],
    "rollout.train.sampling_params.max_new_tokens": [k.format("max_new_tokens") for k in TRAIN_AND_TEST],
    "rollout.train.sampling_params.stop": [k.format("stop") for k in TRAIN_AND_TEST],
    "rollout.train.apply_chat_template": ["data.apply_chat_template"],
    "rollout.train.max_turns": ["rollout.max_turns"],
    "rollout.test.path": ["data.test_path"],
    "rollout.test.prompts_per_rollout": [],
    "rollout.test.sampling_params.temperature": ["rollout.test_sampling_params.temperature"],
    "rollout.test.sampling_params.max_new_tokens": ["rollout.test_sampling_params.max_new_tokens"],
    "rollout.env_path": ["rollout.env_path"],
    "rollout.server_args.model_path": ["actor.model_name", "actor.tokenizer_name"],
    "rollout.server_args.tp_size": ["rollout.tp_size"],
    "actor.model_name": ["actor.model_name", "actor.tokenizer_name"],
    "actor.max_length_per_device": ["actor.max_length_per_device"],
    "actor.cp_size": ["actor.sp_size"],
    "actor.sp_size": ["actor.sp_size"],
    "actor.freeze_steps": ["actor.freeze_steps"],
    "actor.save_freq": ["actor.save_freq"],
    "critic.model_name": ["critic.model_name", "critic.tokenizer_name"],
    "critic.cp_size": ["critic.sp_size"],
    "critic.max_length_per_device": ["critic.max_length_per_device"],
    "adv.estimator": ["adv.estimator"],
    "adv.norm_var": ["adv.norm_var"],
    "trainer.project": ["trainer.project"],
    "trainer.experiment_name": ["trainer.experiment_name"],
    "trainer.total_steps": ["trainer.total_steps"],
    "trainer.test_freq": ["trainer.test_freq"],
    "trainer.save_freq": ["actor.save_freq", "critic.save_freq"],
    "trainer.eval_only": ["trainer.eval_only"],
    "trainer.use_wandb": ["not trainer.disable_wandb"],
    "trainer.n_epochs": ["trainer.n_epochs"],
    "data.train.path": ["data.path"],
    "data.train.max_length": ["data.max_length"],
    "data.train.batch_size": ["data.batch_size"],
    "data.path": ["data.path"],
    "data.max_length": ["data.max_length"],
    "data.batch_size": ["data.batch_size"],
    "data.prompts_per_rollout": ["data.prompts_per_rollout"],
    "data.responses_per_prompt": ["data.responses_per_prompt"],
    "data.train_data_path": ["data.path"],
    "data.test_data_path": ["data.test_path"],
    "train_data.path": ["data.path"],
    "train_data.prompts_per_rollout": ["data.prompts_per_rollout"],
    "train_data.responses_per_prompt": ["data.responses_per_prompt"],
    "train_data.sampling_params.max_new_tokens": [k.format("max_new_tokens") for k in TRAIN_AND_TEST],
    "train_data.sampling_params.stop": [k.format("stop") for k in TRAIN_AND_TEST],
    "train_data.apply_chat_template": ["data.apply_chat_template"],
    "train_data.max_turns": ["rollout.max_turns"],
    "test_data.path": ["data.test_path"],
    "test_data.prompts_per_rollout": [],
    "rollout.train_sampling_params.max_new_tokens": [k.format("max_new_tokens") for k in TRAIN_AND_TEST],
    "rollout.max_turns": ["rollout.max_turns"],
}


def lookup(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def test_the_table_holds_every_argument_of_every_script():
    assert len(SCRIPTS) == 9 + 8 + 6 + 6
    keys = {arg.partition("=")[0] for args in SCRIPTS.values() for arg in args}
    assert keys == set(LANDS_IN)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_argument_lands_in_its_rl2_key(script, capsys):
    """Each argument's value is in each rl2 key it means; each RL2 key named differently from its rl2
    key is reported in one line naming the rl2 key."""
    args = SCRIPTS[script]
    config = load_config(args)
    given = dict(arg.partition("=")[::2] for arg in args)  # the last of a repeated key holds
    for key, text in given.items():
        value = yaml.safe_load(text)
        for target in LANDS_IN[key]:
            if target.startswith("not "):
                assert lookup(config, target[4:]) is (not value), (key, target)
            else:
                assert lookup(config, target) == value, (key, target)
    # ... and nowhere else: the same command line written with rl2's keys gives the same config.
    followers = ("tokenizer_name", "test_sampling_params.max_new_tokens", "test_sampling_params.stop")
    in_rl2_keys = [f"{t.removeprefix('not ')}={'false' if yaml.safe_load(text) else 'true'}" if t.startswith("not ")
                   else f"{t}={text}" for key, text in given.items() for t in LANDS_IN[key]
                   if not t.endswith(followers) or "test." in key]
    assert load_config(in_rl2_keys) == config
    err = capsys.readouterr().err
    for key in given:
        renamed = [t for t in LANDS_IN[key] if not t.endswith(("tokenizer_name", ".test_sampling_params.max_new_tokens",
                                                                ".test_sampling_params.stop")) or "test." in key]
        lines = [line for line in err.splitlines() if line.startswith(f"rl2: RL2's {key} ") or
                 line.startswith(f"rl2: RL2's {key}=")]
        if renamed and renamed != [key]:
            assert len(lines) == 1, (key, err)
            assert all(t.removeprefix("not ") in lines[0] for t in renamed), lines
        elif not renamed:
            assert len(lines) == 1 and "changes nothing in rl2" in lines[0], (key, err)
        else:
            assert not lines, (key, err)


def test_a_key_given_twice_is_reported(capsys):
    config = load_config(SCRIPTS["9161ede/searchr1.sh"])
    assert config.data.path == "test@Chenmien/SearchR1"
    err = capsys.readouterr().err
    assert "rollout.train.path is given twice (train@Chenmien/SearchR1, then test@Chenmien/SearchR1)" in err


# Every row of rl2's table of RL2 keys, key by key: (argument, rl2 keys and values it must set) for
# the renamed keys; (argument, None, part of the note) for the ones accepted without effect; and
# (argument, ConfigError, part of the message) for values that have no rl2 meaning.
KEY_BY_KEY = [
    ("rollout.train.path=a.jsonl", {"data.path": "a.jsonl"}),
    ("rollout.train.prompt_key=question", {"data.prompt_key": "question"}),
    ("rollout.train.messages_key=conversation", {"data.messages_key": "conversation"}),
    ("rollout.train.apply_chat_template=false", {"data.apply_chat_template": False}),
    ("rollout.train.prompts_per_rollout=16", {"data.prompts_per_rollout": 16}),
    ("rollout.train.responses_per_prompt=8", {"data.responses_per_prompt": 8}),
    ("rollout.train.sampling_params.top_p=0.9", {"rollout.train_sampling_params.top_p": 0.9,
                                                 "rollout.train_sampling_params.temperature": 1.0}),
    ("rollout.train.max_turns=3", {"rollout.max_turns": 3}),
    ("rollout.train.dynamic_filtering=false", {"rollout.dynamic_filtering": False}),
    ("rollout.train.partial_rollout=true", {"rollout.partial_rollout": True}),
    ("rollout.train.save_dir=out/train", ConfigError, "<actor.save_dir>/trajectories/"),
    ("rollout.test.path=b.jsonl", {"data.test_path": "b.jsonl"}),
    ("rollout.test.responses_per_prompt=4", {"rollout.test_responses_per_prompt": 4}),
    ("rollout.test.sampling_params.temperature=0.6", {"rollout.test_sampling_params.temperature": 0.6}),
    ("rollout.test.prompts_per_rollout=32", None, "evaluates every test prompt in one rollout"),
    ("rollout.test.save_dir=out/test", ConfigError, "<actor.save_dir>/trajectories/"),
    ("rollout.test_ratio=0.1", {"data.test_ratio": 0.1}),
    ("rollout.bucket_size=256", {"rollout.sync_bucket_mb": 256}),
    ("rollout.server_args.model_path=some/model", {"actor.model_name": "some/model"}),
    ("rollout.server_args.tp_size=2", {"rollout.tp_size": 2, "rollout.server_args": {}}),
    ("rollout.server_args.mem_fraction_static=0.7", {"rollout.gpu_memory_utilization": 0.7}),
    ("rollout.server_args.dtype=float16", {"rollout.dtype": "float16"}),
    ("data.train.path=c.jsonl", {"data.path": "c.jsonl"}),
    ("data.train.max_length=2048", {"data.max_length": 2048}),
    ("data.train.batch_size=32", {"data.batch_size": 32}),
    ("data.train.messages_key=dialog", {"data.messages_key": "dialog"}),
    ("data.train.prompt_key=text", {"data.prompt_key": "text"}),
    ("data.train.apply_chat_template=false", {"data.apply_chat_template": False}),
    ("data.train.response_key=response", None, "SFT rows are conversations"),
    ("data.train.response_key=output", ConfigError, "SFT rows are conversations"),
    ("data.train.chosen_key=chosen", None, "column 'chosen'"),
    ("data.train.chosen_key=good", ConfigError, "column 'chosen'"),
    ("data.train.rejected_key=rejected", None, "column 'rejected'"),
    ("data.train.rejected_key=bad", ConfigError, "column 'rejected'"),
    ("data.test.path=d.jsonl", {"data.test_path": "d.jsonl"}),
    ("actor.kl.coef=0.01", {"kl.coef": 0.01}),
    ("actor.kl.type=loss", {"kl.type": "loss"}),
    ("actor.entropy.coef=0.001", {"actor.entropy_coef": 0.001}),
    ("adv.responses_per_prompt=4", {"data.responses_per_prompt": 4}),
    ("trainer.save_dir=ckpts/x", {"actor.save_dir": "ckpts/x", "critic.save_dir": "ckpts/x"}),
    ("trainer.save_freq=10", {"actor.save_freq": 10, "critic.save_freq": 10}),
    ("trainer.use_wandb=false", {"trainer.disable_wandb": True}),
    ("trainer.use_wandb=true", {"trainer.disable_wandb": False}),
    ("trainer.use_wandb=0", ConfigError, "expected bool"),
    ("train_data.path=e.jsonl", {"data.path": "e.jsonl"}),
    ("train_data.prompts_per_rollout=12", {"data.prompts_per_rollout": 12}),
    ("train_data.responses_per_prompt=6", {"data.responses_per_prompt": 6}),
    ("test_data.path=f.jsonl", {"data.test_path": "f.jsonl"}),
    ("test_data.responses_per_prompt=3", {"rollout.test_responses_per_prompt": 3}),
    ("test_data.response_per_prompt=5", {"rollout.test_responses_per_prompt": 5}),
    ("train_data.max_turns=2", {"rollout.max_turns": 2}),
    ("train_data.sampling_params.max_new_tokens=64", {"rollout.train_sampling_params.max_new_tokens": 64}),
    ("train_data.sampling_params.no_stop_trim=true", None, "keeps the stop string"),
    ("train_data.sampling_params.no_stop_trim=false", ConfigError, "keeps the stop string"),
    ("train_data.max_new_tokens=32", {"rollout.train_sampling_params.max_new_tokens": 32}),
    ("train_data.mask_offpolicy_data=true", None, "actor.rollout_correction"),
    ("train_data.prompt_key=question", {"data.prompt_key": "question"}),
    ("train_data.messages_key=chat", {"data.messages_key": "chat"}),
    ("train_data.apply_chat_template=false", {"data.apply_chat_template": False}),
    ("train_data.experience.max_turns=3", {"rollout.max_turns": 3}),
    ("train_data.experience.max_new_tokens=16", {"rollout.train_sampling_params.max_new_tokens": 16}),
    ("train_data.experience.responses_per_prompt=4", {"data.responses_per_prompt": 4}),
    ("train_data.experience.mask_offpolicy_data=false", None, "actor.rollout_correction"),
    ("test_data.prompts_per_rollout=64", None, "evaluates every test prompt in one rollout"),
    ("test_data.max_turns=2", {"rollout.max_turns": 2}),
    ("test_data.sampling_params.temperature=0.6", {"rollout.test_sampling_params.temperature": 0.6}),
    ("test_data.sampling_params.no_stop_trim=true", None, "keeps the stop string"),
    ("test_data.max_new_tokens=100", {"rollout.test_sampling_params.max_new_tokens": 100}),
    ("test_data.prompt_key=q", {"data.prompt_key": "q"}),
    ("test_data.messages_key=m", {"data.messages_key": "m"}),
    ("test_data.apply_chat_template=false", {"data.apply_chat_template": False}),
    ("test_data.experience.max_turns=2", {"rollout.max_turns": 2}),
    ("test_data.experience.max_new_tokens=8", {"rollout.test_sampling_params.max_new_tokens": 8}),
    ("test_data.experience.responses_per_prompt=3", {"rollout.test_responses_per_prompt": 3}),
    ("rollout.train_prompts_per_rollout=32", {"data.prompts_per_rollout": 32}),
    ("rollout.test_prompts_per_rollout=32", None, "evaluates every test prompt in one rollout"),
    ("rollout.train_sampling_params.no_stop_trim=true", None, "keeps the stop string"),
    ("rollout.train_sampling_params.no_stop_trim=false", ConfigError, "keeps the stop string"),
    ("rollout.test_sampling_params.no_stop_trim=true", None, "keeps the stop string"),
    ("data.response_key=response", None, "SFT rows are conversations"),
    ("data.response_key=output", ConfigError, "SFT rows are conversations"),
    ("data.chosen_key=chosen", None, "column 'chosen'"),
    ("data.rejected_key=bad", ConfigError, "column 'rejected'"),
    ("rollout.model_name=other/model", {"actor.model_name": "other/model"}),
    ("rollout.responses_per_prompt=2", {"data.responses_per_prompt": 2}),
    ("data.train_data_path=g.jsonl", {"data.path": "g.jsonl"}),
    ("data.test_data_path=h.jsonl", {"data.test_path": "h.jsonl"}),
    ("rollout.group_filtering.lower=0.0", None, "rollout.dynamic_filtering"),
    ("rollout.group_filtering.lower=0.2", ConfigError, "rollout.dynamic_filtering"),
    ("rollout.group_filtering.upper=1.0", None, "rollout.dynamic_filtering"),
    ("rollout.group_filtering.upper=0.8", ConfigError, "rollout.dynamic_filtering"),
]
for model in ("actor", "critic"):
    KEY_BY_KEY += [
        (f"{model}.cp_size=4", {f"{model}.sp_size": 4}),
        (f"{model}.enable_gradient_checkpointing=false", {f"{model}.gradient_checkpointing": False}),
        (f"{model}.optimizer.lr=3e-6", {f"{model}.lr": 3e-6}),
        (f"{model}.optimizer.weight_decay=0.0", {f"{model}.weight_decay": 0.0}),
        (f"{model}.scheduler.warmup_ratio=0.1", {f"{model}.warmup_ratio": 0.1}),
        (f"{model}.scheduler.name=cosine_with_min_lr", ConfigError, "cosine decay to 0"),
        (f"{model}.scheduler.min_lr=1e-7", ConfigError, "cosine decay to 0"),
        (f"{model}.scheduler=constant", ConfigError, "cosine decay to 0"),
        (f"{model}.avg_level=sequence", {f"{model}.loss_level": "sequence"}),
        (f"{model}.use_liger_kernel=true", None, f"{model}.logps_chunk_size"),
        (f"{model}.ddp_size=1", None, f"{model}.fsdp_size"),
        (f"{model}.ddp_size=2", ConfigError, f"{model}.fsdp_size"),
        (f"{model}.tp_size=1", None, "not tensor parallelism"),
        (f"{model}.tp_size=2", ConfigError, "not tensor parallelism"),
    ]


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_rl2_lora_keys_are_rl2s_own(model, capsys):
    """RL2's LoRA keys (its lora branch) have the same names and meaning here: no translation, no note."""
    config = load_config([f"{model}.lora.rank=16", f"{model}.lora.alpha=32", f"{model}.lora.dropout=0.05",
                          f"{model}.lora.target_modules=all-linear"])
    lora = getattr(config, model).lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.05, "all-linear")
    assert "RL2's" not in capsys.readouterr().err


@pytest.mark.parametrize("row", KEY_BY_KEY, ids=[row[0] for row in KEY_BY_KEY])
def test_rl2_key(row, capsys):
    arg, expected = row[0], row[1]
    key = arg.partition("=")[0]
    if expected is ConfigError:
        with pytest.raises(ConfigError, match=f"RL2's {key}=.*" if "use_wandb" not in key else "expected bool") as error:
            load_config([arg])
        assert row[2] in str(error.value)
        return
    config = load_config([arg])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rl2: RL2's")]
    assert len(lines) == 1 and key in lines[0]
    if expected is None:
        assert "changes nothing in rl2" in lines[0] and row[2] in lines[0]
        assert config == load_config([])  # it really changes nothing
        return
    for target, value in expected.items():
        assert lookup(config, target) == value, target
    # ... and nowhere else
    assert config == load_config([f"{target}={json.dumps(value)}" for target, value in expected.items()])
    for target in expected:
        assert target in lines[0] or target == "rollout.server_args" or "train_sampling_params.temperature" in target


def test_every_row_of_the_table_is_tested():
    tested = {arg.partition("=")[0] for arg, *_ in KEY_BY_KEY}
    for key in RL2_KEYS:
        prefix = key.name.removesuffix(".*")
        assert any(t == prefix or t.startswith(prefix + ".") for t in tested), key.name


def test_rl2_yaml_layout(tmp_path, capsys):
    """A YAML file in RL2's nested layout; the command line overrides it in either naming."""
    path = tmp_path / "rl2_style.yaml"
    path.write_text(
        "rollout:\n  train:\n    path: train.jsonl\n    responses_per_prompt: 4\n"
        "    sampling_params: {temperature: 0.8, max_new_tokens: 64}\n"
        "  test: {path: test.jsonl}\n  server_args: {tp_size: 2, attention_backend: fa3}\n"
        "actor:\n  model_name: m\n  cp_size: 2\n  optimizer: {lr: 2.0e-6}\n  kl: {coef: 0.001}\n"
        "trainer: {use_wandb: false, save_freq: 8}\n"
    )
    config = load_config([f"config={path}", "rollout.train.sampling_params.max_new_tokens=32", "data.responses_per_prompt=8"])
    assert config.data.path == "train.jsonl" and config.data.test_path == "test.jsonl"
    assert config.data.responses_per_prompt == 8  # the command line wins over the file
    assert config.rollout.train_sampling_params == {"temperature": 0.8, "max_new_tokens": 32}
    assert config.rollout.test_sampling_params == {"temperature": 0.0, "max_new_tokens": 32}
    assert config.rollout.tp_size == 2 and config.rollout.server_args == {"attention_backend": "fa3"}
    assert config.actor.sp_size == 2 and config.actor.lr == 2e-6 and config.kl.coef == 0.001
    assert config.trainer.disable_wandb is True and config.actor.save_freq == 8 == config.critic.save_freq
    err = capsys.readouterr().err
    assert f"RL2's rollout.train.path is rl2's data.path (in {path})" in err
    assert "RL2's rollout.train.sampling_params.max_new_tokens is rl2's rollout.train_sampling_params.max_new_tokens\n" in err


def test_one_rl2_key_and_its_rl2_name_disagree():
    with pytest.raises(ConfigError, match=r"rollout.train.path='a' and data.path='b' both set data.path"):
        load_config(["rollout.train.path=a", "data.path=b"])
    with pytest.raises(ConfigError, match=r"train_data.path='a' and data.train_data_path='c' both set data.path"):
        load_config(["train_data.path=a", "data.train_data_path=c"])
    assert load_config(["rollout.train.path=a", "data.path=a"]).data.path == "a"  # the same value is no conflict


def test_rl2_nov_dec_2025_yaml_layout(tmp_path, capsys):
    """A YAML file in RL2's Nov-Dec 2025 layout (ppo.yaml at 1fce214: train_data / test_data holding the
    sampling params, turns and columns); train and test turns or columns that differ are an error."""
    path = tmp_path / "nov.yaml"
    path.write_text(
        "train_data:\n  path: train.jsonl\n  prompts_per_rollout: 16\n  responses_per_prompt: 4\n  max_turns: 3\n"
        "  mask_offpolicy_data: true\n  sampling_params: {temperature: 0.9, max_new_tokens: 64, no_stop_trim: true}\n"
        "  prompt_key: question\n  apply_chat_template: false\n"
        "test_data:\n  path: test.jsonl\n  prompts_per_rollout: 8\n  sampling_params: {temperature: 0.0}\n"
        "rollout:\n  train_prompts_per_rollout: 16\n  bucket_size: 256\n"
    )
    config = load_config([f"config={path}"], "ppo")
    assert (config.data.path, config.data.test_path, config.data.prompts_per_rollout) == ("train.jsonl", "test.jsonl", 16)
    assert config.data.responses_per_prompt == 4 and config.rollout.max_turns == 3
    assert config.data.prompt_key == "question" and config.data.apply_chat_template is False
    assert config.rollout.train_sampling_params == {"temperature": 0.9, "max_new_tokens": 64}
    assert config.rollout.test_sampling_params == {"temperature": 0.0, "max_new_tokens": 64}
    assert f"RL2's train_data.sampling_params.max_new_tokens is rl2's rollout.train_sampling_params.max_new_tokens " \
           f"(in {path})" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"train_data.max_turns=3 and test_data.max_turns=2 both set rollout.max_turns"):
        load_config(["train_data.max_turns=3", "test_data.max_turns=2"])
    with pytest.raises(ConfigError, match=r"both set data.messages_key"):
        load_config(["train_data.messages_key=a", "test_data.messages_key=b"])


def test_notes_come_from_the_first_process_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert load_config(["rollout.train.path=a"]).data.path == "a"
    assert capsys.readouterr().err == ""


def test_help_lists_rl2_keys():
    text = config_help()
    assert "rollout.train.path -> data.path" in text
    assert "trainer.use_wandb -> trainer.disable_wandb (inverted)" in text
    assert "actor.entropy.coef -> actor.entropy_coef" in text


def readme_countdown_port() -> str:
    """The docs' port of RL2's Countdown env file (Coming from RL2: the block marked `<!-- test: countdown-port -->`)."""
    [block] = blocks_marked("test", "countdown-port")
    return block.text


def test_the_readme_port_of_rl2s_countdown_env_scores_as_rl2s():
    """RL2's env_step: 0 without an answer, 0.1 for a wrong one, 1 for the numbers reaching the target."""
    namespace: dict = {}
    exec(readme_countdown_port(), namespace)
    reward_fn, answer = namespace["reward_fn"], {"numbers": [3, 5, 7], "target": 22}

    def score(text):
        return reward_fn([{"role": "user", "content": "..."}, {"role": "assistant", "content": text}], answer)

    assert score("no answer here") == 0.0
    assert score("<answer>3 * 5 + 7</answer>") == 1.0
    assert score("<answer>(7 - 3) * 5</answer>") == 0.1  # right numbers, wrong value
    assert score("<answer>3 * 5 + 8</answer>") == 0.1  # other numbers
    assert score("<answer>__import__('os')</answer>") == 0.1  # not an equation
    assert score("<answer>3 / (5 - 5) + 7</answer>") == 0.1  # does not evaluate


def test_an_rl2_head_command_line_trains(tiny_model_dir, tmp_path):
    """RL2 HEAD's countdown_reinforce.sh with local files and a tiny model: raw prompts, stop strings,
    the test set and trainer.save_freq all take effect."""
    rows = [{"prompt": f"Using {[i, i + 1]}, make {2 * i + 1}. Answer: <answer>", "answer": {"numbers": [i, i + 1],
             "target": 2 * i + 1}} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "countdown.py").write_text(readme_countdown_port())
    save_dir = tmp_path / "ckpts" / "qwen2.5-3b_reinforce"
    result = run_python([
        "-m", "rl2.trainer.ppo",
        f"rollout.train.path={tmp_path / 'train.jsonl'}", "rollout.train.prompts_per_rollout=2",
        "rollout.train.responses_per_prompt=2", "rollout.train.sampling_params.max_new_tokens=6",
        "rollout.train.sampling_params.stop=['</answer>']", "rollout.train.apply_chat_template=false",
        f"rollout.test.path={tmp_path / 'test.jsonl'}", f"rollout.env_path={tmp_path / 'countdown.py'}",
        f"actor.model_name={tiny_model_dir}", "actor.max_length_per_device=512", "trainer.project=Countdown",
        "trainer.experiment_name=qwen2.5-3b_reinforce", "trainer.total_steps=2", "trainer.test_freq=2",
        "trainer.save_freq=1", "trainer.use_wandb=false",
        # this machine's: a CPU run in float32
        "actor.dtype=float32", f"trainer.save_dir={save_dir}",
    ])
    assert (save_dir / "step1").is_dir() and (save_dir / "step2").is_dir()  # trainer.save_freq=1
    metrics = read_metrics(str(save_dir / "metrics.jsonl"))
    # the test set (2 rows) is evaluated before training and at trainer.test_freq=2, with no reward errors
    assert [row["step"] for row in metrics if "test/reward_mean" in row] == [0, 2]
    assert all(row["test/reward_errors"] == 0 for row in metrics if "test/reward_errors" in row)
    assert "RL2's rollout.train.path is rl2's data.path" in result.stderr
    trajectories = [json.loads(line) for line in open(save_dir / "trajectories" / "step_1.jsonl")]
    assert len(trajectories) == 4 and all(t["messages"][0]["content"].startswith("Using") for t in trajectories)


def script_command(script: str) -> str:
    """The rl2 command an RL2 example script runs (RL2's trainer of the same name)."""
    name = script.split("/")[1]
    return "sft" if "_sft" in name else "rm" if "_rm" in name else "dpo" if "_dpo" in name else "ppo"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_script_parses_under_its_command(script):
    """Each argument of RL2's scripts is read by the command the script runs: none is refused as a key
    that command does not read (RL2's trainer.save_freq, meaning actor.save_freq and critic.save_freq,
    is read by whichever model the command trains)."""
    load_config(SCRIPTS[script], script_command(script))


def test_rl2run_is_installed_as_a_command():
    from importlib.metadata import entry_points

    [entry] = [e for e in entry_points(group="console_scripts") if e.name == "rl2run"]
    assert entry.value == "rl2.launch:main"
