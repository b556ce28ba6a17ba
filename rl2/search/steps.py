"""The step format of code-augmented chain of thought (rStar-Math).

A step is reasoning and, optionally, one Python block, ended by the step delimiter; the last step
ends with the answer delimiter (or the end of the sequence) and holds the final answer:

    Add the two numbers.
    ```python
    total = 3 + 4
    print(total)
    ```<end_of_step>
    ```output
    7
    ```
    The answer is \\boxed{7}.<end_of_answer>

Generation of a step stops at either delimiter. The program of a step runs after the programs of
every earlier step on its path (so variables carry over), and what it prints is appended after the
delimiter as an output block, which the next step sees. A step whose program fails is invalid.
"""

import re
from dataclasses import dataclass

CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
# Printed between the earlier steps' programs and the step's own: what follows it is the step's output.
OUTPUT_MARKER = "<<rl2-step-output>>"


@dataclass
class StepFormat:
    """The delimiters that end a step and a solution, and how much program output a step shows."""

    step_end: str = "<end_of_step>"
    answer_end: str = "<end_of_answer>"
    max_output_chars: int = 512

    @property
    def stops(self) -> list[str]:
        return [self.step_end, self.answer_end]


@dataclass
class Step:
    """One generated step before its program has run."""

    text: str  # generated text up to and including its delimiter
    code: str | None  # the step's program (its python blocks, joined), None when it has none
    final: bool  # ends the solution (answer delimiter or end of sequence)
    error: str | None = None  # set when the step is unusable as generated


def parse_step(text: str, finish_reason: str, fmt: StepFormat, eos_texts: tuple[str, ...] = ()) -> Step:
    """The step in a generation's decoded `text`: cut after the first delimiter; a generation that
    ended without one is final if the model ended it (eos), and invalid if it hit the token limit."""
    ends = [(text.find(delimiter), delimiter) for delimiter in fmt.stops if delimiter in text]
    if ends:
        position, delimiter = min(ends)
        text = text[: position + len(delimiter)]
        final, error = delimiter == fmt.answer_end, None
    else:
        for eos in eos_texts:
            if eos and text.endswith(eos):
                text = text[: -len(eos)]
        final = finish_reason == "stop"
        error = None if final else f"step did not end within the token limit ({finish_reason})"
    blocks = CODE_BLOCK.findall(text)
    code = "\n".join(block.rstrip() for block in blocks) if blocks else None
    return Step(text=text, code=code, final=final, error=error)


def step_program(history: list[str], code: str) -> str:
    """The program that runs a step: the earlier steps' programs, a marker line, then its own."""
    return "\n".join([*history, f"print({OUTPUT_MARKER!r}, flush=True)", code]) + "\n"


def step_output(stdout: str) -> str:
    """What the step's own program printed (the text after the marker line)."""
    head, marker, tail = stdout.partition(OUTPUT_MARKER + "\n")
    return tail if marker else stdout


def output_block(output: str, fmt: StepFormat) -> str:
    """The output block appended after a step with a program (long output cut in the middle)."""
    output = output.rstrip("\n")
    if len(output) > fmt.max_output_chars:
        half = fmt.max_output_chars // 2
        output = f"{output[:half]}\n...[{len(output) - 2 * half} characters cut]...\n{output[-half:]}"
    return f"\n```output\n{output}\n```\n"
