import dataclasses

import pytest
from omegaconf import OmegaConf

from rl2.config import (
    ActorConfig,
    Config,
    ConfigError,
    CriticConfig,
    config_help,
    config_to_dict,
    load_config,
)


def test_defaults():
    c = load_config()
    assert isinstance(c, Config) and type(c.actor) is ActorConfig and type(c.critic) is CriticConfig
    assert c.actor.beta == 0.1 and c.actor.label_smoothing == 0.0 and c.ref_actor.offload_model is False
    assert not hasattr(c.critic, "beta")  # DPO keys live on the actor only
    # RL2's defaults (docs/migration/from-rl2.md, "Defaults", for the ones rl2 does not share)
    assert c.data.batch_size == 128 and c.data.test_ratio == 0.03 and c.data.path is None and c.data.shuffle is True
    assert c.actor.lr == 1e-6 and c.actor.clip == 0.2 and c.actor.dtype == "bfloat16"
    assert c.actor.warmup_ratio == c.critic.warmup_ratio == 0.03
    assert c.critic.lr == 5e-6 and c.critic.clip == 0.5
    assert c.rollout.engine == "hf" and c.rollout.dynamic_filtering is True
    assert c.rollout.train_sampling_params == {"temperature": 1.0, "max_new_tokens": 512}
    assert c.rollout.test_sampling_params == {"temperature": 0.0, "max_new_tokens": 512}  # max_new_tokens: train's
    assert c.actor.save_dir == c.critic.save_dir == "ckpts/run" and c.trainer.experiment_name == "run"
    assert c.kl.type == "reward" and c.adv.estimator == "reinforce" and c.trainer.seed == 42
    assert load_config([]) == c


def test_default_dicts_are_not_shared():
    a, b = load_config(), load_config()
    a.rollout.train_sampling_params["x"] = 1
    assert "x" not in b.rollout.train_sampling_params
    assert "x" not in Config().rollout.train_sampling_params


def test_overrides_of_each_type():
    c = load_config([
        "data.batch_size=32",
        "actor.lr=1e-5",
        "critic.clip=0.3",
        "trainer.disable_wandb=true",
        "data.shuffle=false",
        "actor.model_name=Qwen/Qwen2.5-0.5B",
        "trainer.experiment_name='my run'",
        "data.max_length=null",
        "rollout.train_sampling_params.stop=['</answer>']",
        "rollout.test_sampling_params.extra={a: {b: 2}}",
        "rollout.test_sampling_params.max_new_tokens=64",
    ])
    assert c.data.batch_size == 32 and type(c.data.batch_size) is int
    assert c.actor.lr == 1e-5 and type(c.actor.lr) is float
    assert c.critic.clip == 0.3
    assert c.trainer.disable_wandb is True and c.data.shuffle is False
    assert c.actor.model_name == "Qwen/Qwen2.5-0.5B"
    assert c.trainer.experiment_name == "my run"
    assert c.data.max_length is None
    stop = c.rollout.train_sampling_params["stop"]
    assert type(stop) is list and stop == ["</answer>"]
    assert c.rollout.train_sampling_params["temperature"] == 1.0  # merged, not replaced
    assert c.rollout.test_sampling_params == {"temperature": 0.0, "max_new_tokens": 64, "extra": {"a": {"b": 2}},
                                              "stop": ["</answer>"]}  # stop: train's
    assert type(c.rollout.test_sampling_params["extra"]) is dict


def test_test_sampling_params_inherit_the_training_ones_they_do_not_set(tmp_path):
    """RL2's test sampling: temperature 0, max_new_tokens and stop as in training; a run trained at 16 new
    tokens is tested at 16, not at a fixed 512."""
    c = load_config(["rollout.train_sampling_params={temperature: 0.8, max_new_tokens: 16, stop: ['</a>'], top_p: 0.9}"])
    assert c.rollout.test_sampling_params == {"temperature": 0.0, "max_new_tokens": 16, "stop": ["</a>"], "top_p": 0.9}
    assert c.rollout.train_sampling_params == {"temperature": 0.8, "max_new_tokens": 16, "stop": ["</a>"], "top_p": 0.9}
    c = load_config(["rollout.train_sampling_params.max_new_tokens=16", "rollout.test_sampling_params.stop=[]",
                     "rollout.test_sampling_params.max_new_tokens=64", "rollout.train_sampling_params.stop=['</a>']"])
    assert c.rollout.test_sampling_params == {"temperature": 0.0, "max_new_tokens": 64, "stop": []}  # its own win
    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  train_sampling_params: {temperature: 1.0, max_new_tokens: 24}\n"
                      "  test_sampling_params: {temperature: 0.6}\n")
    c = load_config([f"config={config}"])
    assert c.rollout.test_sampling_params == {"temperature": 0.6, "max_new_tokens": 24}
    from rl2.engines import SamplingParams  # what the rollout service builds the test parameters from

    assert SamplingParams.from_dict(c.rollout.test_sampling_params).max_new_tokens == 24


def test_save_dir_defaults_to_the_experiment_name(tmp_path):
    """RL2's `trainer.save_dir: ckpts/${trainer.experiment_name}`: two runs with different names never share
    a folder; a save_dir given explicitly is kept."""
    c = load_config(["trainer.experiment_name=grpo_a"])
    assert c.actor.save_dir == c.critic.save_dir == "ckpts/grpo_a"
    c = load_config(["trainer.experiment_name=grpo_a", "actor.save_dir=out/x"])
    assert c.actor.save_dir == "out/x" and c.critic.save_dir == "ckpts/grpo_a"
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  experiment_name: from_yaml\n")
    assert load_config([f"config={config}", "critic.save_dir=rm"]).actor.save_dir == "ckpts/from_yaml"


def test_int_given_to_float_field_is_converted():
    assert type(load_config(["actor.lr=1"]).actor.lr) is float


def test_yaml_then_cli(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "actor:\n  lr: 1e-5\n  model_name: m\n"
        "data:\n  batch_size: 16\n"
        "rollout:\n  train_sampling_params:\n    stop: ['</answer>']\n"
    )
    c = load_config([f"config={path}", "data.batch_size=4"])
    assert c.actor.lr == 1e-5 and c.actor.model_name == "m"
    assert c.data.batch_size == 4  # CLI wins over YAML
    assert c.rollout.train_sampling_params["stop"] == ["</answer>"]
    # order on the command line does not matter: YAML is always applied first
    assert load_config(["data.batch_size=4", f"config={path}"]) == c


def test_interpolation():
    c = load_config(["actor.model_name=m", "critic.model_name=${actor.model_name}", "critic.lr=${actor.lr}"])
    assert c.critic.model_name == "m" and c.critic.lr == 1e-6


def test_tokenizer_defaults_to_model():
    c = load_config(["actor.model_name=m", "critic.model_name=v"])
    assert c.actor.tokenizer_name == "m" and c.critic.tokenizer_name == "v"
    c = load_config(["actor.model_name=m", "actor.tokenizer_name=t"])
    assert c.actor.tokenizer_name == "t"


def test_unknown_section():
    with pytest.raises(ConfigError) as e:
        load_config(["foo.bar=1"])
    msg = str(e.value)
    sections = "actor, adv, critic, data, distill, filter, kl, ref_actor, rollout, search, teacher, trainer"
    assert "'foo.bar'" in msg and sections in msg and "did you mean" not in msg  # nothing is close


@pytest.mark.parametrize("arg, meant", [
    ("actor.lrr=1e-5", "actor.lr"),
    ("acter.lr=1e-5", "actor.lr"),  # a misspelled section
    ("data.prompt_per_rollout=8", "data.prompts_per_rollout"),
    ("critic.model=m", "critic.model_name"),
    ("trainer.use_wandbb=false", "trainer.use_wandb"),  # RL2's keys are valid keys too
    ("rollout.train.pathh=x", "rollout.train.path"),
    ("train_data.sampling_param.stop=x", "train_data.sampling_params"),
])
def test_a_misspelled_key_names_the_closest_valid_one(arg, meant):
    with pytest.raises(ConfigError) as e:
        load_config([arg])
    assert f"unknown config key '{arg.partition('=')[0]}'; did you mean {meant}?; valid keys" in str(e.value)


def test_did_you_mean_names_every_key_about_as_close():
    from rl2.config.suggest import closest, did_you_mean

    assert closest("actor.clipp", ["actor.clip", "actor.clip_c", "critic.clip", "actor.lr"]) == ["actor.clip"]
    assert closest("max_token", ["max_tokens", "max_tokenz", "temperature"]) == ["max_tokens", "max_tokenz"]
    assert did_you_mean("zzz", ["actor", "critic"]) == ""
    assert did_you_mean("stopp", ["stop", "top_p"]) == "; did you mean stop?"


def test_unknown_nested_key():
    with pytest.raises(ConfigError) as e:
        load_config(["actor.lrr=1e-5"])
    msg = str(e.value)
    assert "'actor.lrr'" in msg and "under 'actor'" in msg
    assert "clip, clip_c, clip_high, compile, correction_threshold, dtype" in msg and "lr" in msg


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  enigne: sglang\n")
    with pytest.raises(ConfigError) as e:
        load_config([f"config={path}"])
    msg = str(e.value)
    assert "'rollout.enigne'" in msg and "engine" in msg and str(path) in msg


def test_section_given_a_value():
    with pytest.raises(ConfigError, match="'actor' is a section"):
        load_config(["actor=3"])


@pytest.mark.parametrize("arg, key, expected, given", [
    ("actor.lr=abc", "actor.lr", "float", "'abc'"),
    ("data.batch_size=1.5", "data.batch_size", "int", "1.5"),
    ("trainer.disable_wandb=maybe", "trainer.disable_wandb", "bool", "'maybe'"),
    ("trainer.disable_wandb=2", "trainer.disable_wandb", "bool", "2"),
    ("data.batch_size=null", "data.batch_size", "int", "None"),
    ("rollout.train_sampling_params=5", "rollout.train_sampling_params", "dict", "5"),
])
def test_wrong_type(arg, key, expected, given):
    with pytest.raises(ConfigError) as e:
        load_config([arg])
    msg = str(e.value)
    assert f"'{key}'" in msg and f"expected {expected}" in msg and given in msg
    assert "full_key" not in msg and "object_type" not in msg


def test_bad_interpolation():
    with pytest.raises(ConfigError, match="data.batch_size.*nope.x"):
        load_config(["data.batch_size=${nope.x}"])


def test_bad_choice():
    with pytest.raises(ConfigError) as e:
        load_config(["rollout.engine=trt"])
    msg = str(e.value)
    assert "'rollout.engine'" in msg and "'trt'" in msg and "hf, sglang, vllm" in msg
    with pytest.raises(ConfigError, match="k1, k2, k3"):
        load_config(["kl.loss_estimator=k4"])


def test_a_choice_yaml_reads_as_a_bool_is_its_word(tmp_path):
    """YAML 1.1 reads `off` as false: `actor.router_replay=off` (the command line's or a file's) is still "off"."""
    assert load_config(["actor.router_replay=r2", "actor.router_replay=off"]).actor.router_replay == "off"
    path = tmp_path / "recipe.yaml"
    path.write_text("actor:\n  router_replay: off\n")
    assert load_config([f"config={path}"]).actor.router_replay == "off"
    with pytest.raises(ConfigError, match="'True'; choose one of off, r2, r3"):
        load_config(["actor.router_replay=on"])


@pytest.mark.parametrize("arg", ["actor.lr", "--actor.lr=1e-5", "=3"])
def test_bad_arg_form(arg):
    with pytest.raises(ConfigError, match="key=value"):
        load_config([arg])


def test_unparsable_value():
    with pytest.raises(ConfigError, match="actor.lr=\\[1"):
        load_config(["actor.lr=[1"])


def test_missing_yaml(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config([f"config={path}"])


def test_yaml_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config([f"config={path}"])


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(flag, capsys):
    with pytest.raises(SystemExit) as e:
        load_config(["actor.lr=1", flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.strip() == config_help().strip()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type):
            if dataclasses.is_dataclass(f.type):  # a nested section: its heading, then its keys
                assert f"\n{section.name}.{f.name}: " in out
                assert all(f"  {section.name}.{f.name}.{g.name}: " in out for g in dataclasses.fields(f.type))
            else:
                assert f"  {section.name}.{f.name}: " in out
    assert "  actor.lr: float = 1e-06  — learning rate of the optimizer" in out
    assert "critic.lr: float = 5e-06" in out
    assert "data.max_length: Optional[int] = None" in out
    assert "choices: hf, sglang" in out


def test_every_field_has_help():
    def check(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            if dataclasses.is_dataclass(f.type):
                check(f.type)
    check(Config)


def test_config_to_dict_roundtrip(tmp_path):
    c = load_config(["actor.model_name=m", "rollout.train_sampling_params.stop=['</answer>']", "kl.coef=0.1"])
    d = config_to_dict(c)
    assert type(d) is dict and type(d["actor"]) is dict and d["actor"]["model_name"] == "m"
    assert d["rollout"]["train_sampling_params"]["stop"] == ["</answer>"]
    path = tmp_path / "saved.yaml"
    OmegaConf.save(d, path)
    assert load_config([f"config={path}"]) == c
