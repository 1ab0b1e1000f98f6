"""Turn a question into chat messages. Evaluation, training and the prime-rl plug-in all call this.

The format follows the run guide's taskset: the row's own ``prompt.default``
instruction as the system message, then the question, a blank line and one
``"A. text"`` line per option as the user message.
"""

from __future__ import annotations

from scirl.task.schema import Question

NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def default_instruction(labels: tuple[str, ...] | list[str]) -> str:
    """The instruction SciKnowEval uses for MCQ rows, for rows that carry none."""
    n = len(labels)
    count = NUMBER_WORDS.get(n, str(n))
    quoted = [f'"{label}"' for label in labels]
    choices = quoted[0] if n == 1 else ", ".join(quoted[:-1]) + f" or {quoted[-1]}"
    return (
        f"Given a question and {count} options, please select the right answer. "
        f"Your answer should be {choices}. Please directly give the answer without any explanation."
    )


def user_text(q: Question) -> str:
    options = "\n".join(f"{label}. {text}" for label, text in zip(q.labels, q.options))
    return f"{q.question}\n\n{options}"


def build_messages(q: Question) -> list[dict[str, str]]:
    instruction = q.instruction if q.instruction and q.instruction.strip() else default_instruction(q.labels)
    return [
        {"role": "system", "content": instruction},
        {"role": "user", "content": user_text(q)},
    ]


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """Chat-template the messages, ending with the assistant turn's opening.

    Tokenizers without a chat template (raw base checkpoints) get a plain
    transcript, so a model without one still gets a well-formed prompt.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"
