"""One GRPO update of the PPO trainer against an independent reference on the same batch.

The reference is written from the algorithm, not from rl2: a plain transformers model run on one
sequence at a time, rewards normalised within each group by hand, the clipped surrogate summed over
the tokens the policy generated (its end-of-turn token included, tool tokens not) and divided by
their number in the batch, then clipping and one AdamW step written out. A wrong sign, a token
left in or out of the loss, another normalisation, or another learning rate fails it. Compared are
the gradients before the optimizer (exact up to float rounding) and the step taken from them
(relative to the learning rate), never parameters after two independent Adam steps, which amplify
rounding in near-zero gradients to a whole step.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import run_python, run_torchrun
from rl2.chat.template import render_chat
from test_ppo import rl_data  # noqa: F401  (the fixture)

WORKER = "tests/workers/grpo_update_capture.py"
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 1e-2, 1.0  # the demo's learning rate; the config's defaults
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8  # torch.optim.AdamW's defaults, which rl2 uses
GROUP_SIZE = 4


def make_batch(tokenizer) -> list[dict]:
    """Two groups of four: single-turn answers ending with the end-of-turn token, one cut at the
    length limit (no end token), and one two-turn answer with tool tokens between the turns."""
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    batch = []
    for group, (number, responses) in enumerate([
        (3, [("\\boxed{4}", 1.0), ("The answer is 4.", 0.0), ("The answer is 5.", 0.0), ("\\boxed{4}", 1.0)]),
        (7, [("\\boxed{8}", 1.0), ("The answer is 8.", 0.0), ("The answer", 0.0), ("tool", 1.0)]),
    ]):
        prompt = ids(render_chat([{"role": "user", "content": f"What number comes after {number}?"}], tokenizer,
                                 add_generation_prompt=True))
        for text, reward in responses:
            if text == "tool":  # generated, tool output (not generated), generated
                first, tool, second = ids("<tool_call>lookup</tool_call>") + [eos], ids(
                    "\n<|im_start|>tool\ncode 8<|im_end|>\n<|im_start|>assistant\n"), ids("\\boxed{8}") + [eos]
                response, mask = first + tool + second, [1] * len(first) + [0] * len(tool) + [1] * len(second)
            else:
                response = ids(text) + ([] if text == "The answer" else [eos])  # "The answer": cut, no end token
                mask = [1] * len(response)
            batch.append({"token_ids": prompt + response, "action_mask": [0] * len(prompt) + mask, "reward": reward, "group": group})
    return batch


def reference_gradients(model_dir: str, batch: list[dict]) -> tuple[dict[str, torch.Tensor], float]:
    """The clipped gradient of the GRPO loss, one sequence at a time, and the number of loss tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rewards = torch.tensor([row["reward"] for row in batch], dtype=torch.float64)
    advantages = []
    for start in range(0, len(batch), GROUP_SIZE):
        group = rewards[start : start + GROUP_SIZE]
        std = group.std()  # unbiased, as GRPO
        advantages += ((group - group.mean()) / (std + 1e-6)).tolist() if std > 0 else [0.0] * GROUP_SIZE
    loss_tokens = sum(sum(row["action_mask"]) for row in batch)
    for row, advantage in zip(batch, advantages):
        ids = torch.tensor([row["token_ids"]])
        logits = model(input_ids=ids).logits[0].float()
        # token t is predicted at position t - 1; the first token of a sequence has no prediction
        logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(row["action_mask"][1:], dtype=torch.float32)
        ratio = torch.exp(logps - logps.detach())  # 1 on the first update, with the gradient of logps
        # PPO's clipped surrogate; at ratio 1 the clip is inactive, so min(r A, clip(r) A) = r A
        loss = -(advantage * ratio * mask).sum() / loss_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    return {name: p.grad for name, p in model.named_parameters()}, loss_tokens


def adamw_first_step(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """AdamW's first step (Loshchilov & Hutter 2019), written out: decoupled weight decay, then the
    bias-corrected moments m = g and v = g², i.e. a step of lr * g / (|g| + eps) per element."""
    m = (1 - BETA1) * grad / (1 - BETA1)
    v = (1 - BETA2) * grad**2 / (1 - BETA2)
    return param * (1 - lr * WEIGHT_DECAY) - lr * m / (v.sqrt() + EPS)


@pytest.mark.parametrize("ranks", [1, 2])
def test_grpo_update_matches_an_independent_reference(tiny_model_dir, rl_data, tmp_path, ranks):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = make_batch(tokenizer)
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    args = [WORKER, tiny_model_dir, f"{rl_data}/train.jsonl", "envs/demo_successor.py", str(tmp_path / "batch.json"),
            str(tmp_path / "out.pt"), f"data.responses_per_prompt={GROUP_SIZE}", "data.prompts_per_rollout=2",
            f"actor.lr={LR}", "actor.warmup_ratio=0.0", "trainer.total_steps=60", "adv.estimator=reinforce",
            "adv.norm_var=true", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 12}"]
    run_python(args) if ranks == 1 else run_torchrun(args)
    result = torch.load(tmp_path / "out.pt")

    expected_grads, loss_tokens = reference_gradients(tiny_model_dir, batch)
    assert result["metrics"]["actor/loss_tokens"] == loss_tokens  # end tokens in, prompt and tool tokens out
    assert result["lr"] == pytest.approx(LR, rel=1e-12)  # the first step of the cosine schedule: the full rate
    assert set(result["grads"]) == set(expected_grads)
    for name, expected in expected_grads.items():
        # Same float32 arithmetic in another order (packed rows vs one sequence, 1 vs 2 ranks): errors
        # of ~1e-6 relative to the gradient's scale; a token in or out of the loss changes it by ~1/40.
        scale = expected.abs().max().item()
        torch.testing.assert_close(result["grads"][name], expected, rtol=0, atol=1e-4 * scale, msg=name)

    for name, grad in result["grads"].items():
        # The optimizer's step from the captured gradient: the same formula up to rounding, so within
        # a thousandth of the learning rate (the step of every element with a gradient is ~lr).
        expected = adamw_first_step(result["before"][name], grad, LR)
        torch.testing.assert_close(result["after"][name], expected, rtol=0, atol=1e-3 * LR, msg=name)
        moved = (result["after"][name] - result["before"][name]).abs().max().item()
        assert moved == pytest.approx(LR, rel=0.05), name  # Adam's first step moves every weight by ~lr
