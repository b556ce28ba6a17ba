"""Value-head models of Qwen-VL models, the token and sequence classification classes that transformers has for
text models but not for Qwen2.5-VL or Qwen3-VL: the image-text-to-text model's backbone (`model`, e.g.
`Qwen2_5_VLModel`: vision tower and text model) with a linear `score` head, built from transformers' own
generic heads, so their weights and config read as transformers' `*ForTokenClassification` /
`*ForSequenceClassification` do (`score.weight`, `score.bias`, `num_labels`).

`from_pretrained` takes a vision-language model's folder (its `lm_head` is left out, the `score` head is new)
or one these classes saved (a critic's, a reward model's); either checkpoint layout of the backbone's weights
(`model.language_model.*` / `model.visual.*`, or the released Qwen2.5-VL checkpoints' `model.*` / `visual.*`)
loads. To load a saved folder with transformers' Auto classes, register the class first, e.g.
`AutoModelForSequenceClassification.register(Qwen2_5_VLConfig, Qwen2_5_VLForSequenceClassification)`.
"""

from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, PretrainedConfig
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPreTrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLPreTrainedModel

# The released checkpoints' names of the backbone's weights → the backbone's own (what transformers' Qwen-VL
# `...ForConditionalGeneration` renames on loading); names already in the backbone's form are left as they are.
BACKBONE_KEYS = {r"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"}


class _VisionHead:
    """`from_pretrained` reading the backbone's weights under either of their names; `from_config` as the Auto
    classes name it (what `rl2.distributed.fsdp.load_fsdp_model` calls on the meta device)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return super().from_pretrained(*args, key_mapping=kwargs.pop("key_mapping", BACKBONE_KEYS), **kwargs)

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs):
        return cls._from_config(config, **kwargs)


class Qwen2_5_VLForTokenClassification(_VisionHead, GenericForTokenClassification, Qwen2_5_VLPreTrainedModel):
    """Qwen2.5-VL with a `score` head at every token (logits [batch, tokens, num_labels])."""


class Qwen2_5_VLForSequenceClassification(_VisionHead, GenericForSequenceClassification, Qwen2_5_VLPreTrainedModel):
    """Qwen2.5-VL with a `score` head (no bias) read at each row's last token that is not padding."""


class Qwen3VLForTokenClassification(_VisionHead, GenericForTokenClassification, Qwen3VLPreTrainedModel):
    """Qwen3-VL with a `score` head at every token (logits [batch, tokens, num_labels])."""


class Qwen3VLForSequenceClassification(_VisionHead, GenericForSequenceClassification, Qwen3VLPreTrainedModel):
    """Qwen3-VL with a `score` head (no bias) read at each row's last token that is not padding."""


# {transformers Auto head class: {vision-language config class name: its value-head class}}
HEADS = {
    AutoModelForTokenClassification: {"Qwen2_5_VLConfig": Qwen2_5_VLForTokenClassification,
                                      "Qwen3VLConfig": Qwen3VLForTokenClassification},
    AutoModelForSequenceClassification: {"Qwen2_5_VLConfig": Qwen2_5_VLForSequenceClassification,
                                         "Qwen3VLConfig": Qwen3VLForSequenceClassification},
}


def vision_head_class(config: PretrainedConfig, head: type) -> type:
    """The class of a vision-language model of `config` with the head of `head` (transformers'
    `AutoModelForTokenClassification` or `AutoModelForSequenceClassification`); a ValueError for another head
    or a family without one here."""
    if head not in HEADS:
        raise ValueError(f"no vision-language class with the head of {head.__name__}")
    classes = HEADS[head]
    family = type(config).__name__
    if family not in classes:
        raise ValueError(f"no {head.__name__.removeprefix('AutoModelFor')} class for {family} models "
                         f"(rl2 has them for {', '.join(sorted(classes))})")
    return classes[family]
