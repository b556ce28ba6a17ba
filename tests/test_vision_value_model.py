"""The value-head classes of Qwen-VL models (`rl2.vision.value_model`, issue 68), for both families: built from a
vision-language model's folder they hold its backbone's weights exactly (either checkpoint layout) and a fresh
`score` head; a saved one loads back to the same weights and outputs; a head or family without a class is a
ValueError. (The critic and the reward model that use them are tested in test_vision_ppo.py, test_vision_dpo.py.)"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification
from transformers import AutoModelForSequenceClassification as SequenceHead

from rl2.testing.tiny_vlm import save_tiny_vlm
from rl2.vision.value_model import vision_head_class

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
HEADS = [AutoModelForTokenClassification, SequenceHead]


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> str:
    return save_tiny_vlm(str(tmp_path_factory.mktemp(request.param)), family=request.param)


@pytest.mark.parametrize("head", HEADS, ids=["token", "sequence"])
def test_the_backbone_comes_from_the_vlm_and_a_saved_model_reloads(model_dir, head, tmp_path):
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    cls = vision_head_class(config, head)
    model = cls.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    vlm = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    backbone = vlm.model.state_dict()
    ours = model.state_dict()
    scores = sorted(name for name in ours if name.startswith("score."))
    assert sorted(ours) == sorted([f"model.{name}" for name in backbone] + scores)
    assert scores == (["score.bias", "score.weight"] if head is AutoModelForTokenClassification else ["score.weight"])
    assert all(torch.equal(ours[f"model.{name}"], value) for name, value in backbone.items())
    assert model.score.weight.shape == (1, config.text_config.hidden_size) and model.score.weight.abs().sum() > 0

    model.save_pretrained(str(tmp_path))
    again = cls.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(again) is cls and all(torch.equal(again.state_dict()[name], value) for name, value in ours.items())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert logits.shape == ((1, 4, 1) if head is AutoModelForTokenClassification else (1, 1))
        assert torch.equal(again(input_ids=ids).logits, logits)


def test_heads_and_families_without_a_class_are_value_errors(model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="AutoModelForCausalLM"):
        vision_head_class(AutoConfig.from_pretrained(model_dir), AutoModelForCausalLM)
    with pytest.raises(ValueError, match="Qwen2Config"):
        vision_head_class(AutoConfig.from_pretrained(tiny_model_dir), SequenceHead)
