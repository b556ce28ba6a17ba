"""A trained reward model that scores conversations, e.g. inside an env file's `reward_fn`."""

import threading

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rl2.data import render_chat


class RewardScorer:
    """Scores conversations with a reward model folder: one written by `rl2.trainer.rm`, or any
    one-label `AutoModelForSequenceClassification` folder with a chat template.

    A conversation is rendered with the folder's chat template and tokenised as in training (the
    whole text at once, no special tokens added, cut to `max_length` keeping the start); its score
    is the head's output at the last token. Calls from many threads are served one at a time.
    """

    def __init__(
        self, path: str, device: str | None = None, dtype: str | torch.dtype = "auto", max_length: int | None = None
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has one label, this one has {self.model.config.num_labels}")
        self.max_length = max_length
        self._lock = threading.Lock()

    def token_ids(self, messages: list[dict]) -> list[int]:
        """The token ids the model scores for `messages` (the assistant's reply included)."""
        text = render_chat(messages, self.tokenizer, add_generation_prompt=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])[: self.max_length]

    @torch.no_grad()
    def score(self, messages: list[dict]) -> float:
        """The reward of a conversation."""
        input_ids = torch.tensor([self.token_ids(messages)], device=self.device)
        with self._lock:
            return float(self.model(input_ids=input_ids, use_cache=False).logits[0, 0])
