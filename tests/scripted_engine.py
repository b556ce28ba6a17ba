"""An engine whose replies a test scripts, for driving the rollout machinery without a model."""

from rl2.engines import Engine, Generation


class ScriptedEngine(Engine):
    """Answers with text chosen by `reply(conversation_text)`, tokenised canonically; `end` says
    how the turn ends: "eos" appends <|im_end|>, "stop" ends on the text (a stop string),
    "length" cuts at max_new_tokens."""

    def __init__(self, tokenizer, reply, end="eos"):
        self.tokenizer, self.reply, self.end = tokenizer, reply, end
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            tokens = self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"]
            finish = "stop"
            if self.end == "eos":
                tokens = tokens + [self.tokenizer.eos_token_id]
            if len(tokens) > params.max_new_tokens:
                tokens, finish = tokens[: params.max_new_tokens], "length"
            out.append(Generation(token_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason=finish))
        return out

    def update_weights(self, named_tensors, partial=False):
        raise NotImplementedError
