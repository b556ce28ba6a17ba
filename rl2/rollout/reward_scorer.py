"""A trained reward model that scores conversations, e.g. inside an env file's `reward_fn`."""

import threading

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rl2.chat.template import render_chat


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

    @torch.no_grad()
    def score_many(self, conversations: list[list[dict]], batch_tokens: int = 16384) -> list[float]:
        """The rewards of many conversations, in batches of about `batch_tokens` padded tokens.

        Conversations of similar length are batched together, left-padded with explicit position
        ids, and the head is applied to the base model's last position, so each score is the one
        `score` gives (up to float rounding). A model without a `score` head (the decoder LLMs'
        name for it) is scored one conversation at a time.
        """
        head = getattr(self.model, "score", None)
        if head is None:
            return [self.score(messages) for messages in conversations]
        sequences = [self.token_ids(messages) for messages in conversations]
        scores = [0.0] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        batch: list[int] = []
        for position, i in enumerate(order):
            batch.append(i)
            after = order[position + 1] if position + 1 < len(order) else None
            if after is None or (len(batch) + 1) * len(sequences[after]) > batch_tokens:
                for j, value in zip(batch, self._score_batch([sequences[j] for j in batch], head)):
                    scores[j] = value
                batch = []
        return scores

    def _score_batch(self, sequences: list[list[int]], head: torch.nn.Module) -> list[float]:
        width = max(len(ids) for ids in sequences)
        input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with self._lock:
            hidden = self.model.base_model(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                position_ids=position_ids.to(self.device), use_cache=False,
            ).last_hidden_state
            return head(hidden[:, -1]).float()[:, 0].tolist()
