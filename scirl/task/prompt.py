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


# The self-teacher's prompt of self-distillation (Hübotter et al. 2026, arXiv 2601.20802; scirl.algorithms): the
# wording of the reference code's `self_distillation` templates (`verl/trainer/config/actor/actor.yaml`:
# reprompt_template, solution_template, feedback_template), applied to the question's user message as there.
SOLUTION_SECTION = "\nCorrect solution:\n\n{solution}"
FEEDBACK_SECTION = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}"
REPROMPT = "{question}{solution}{feedback}\n\nCorrectly solve the original question."


def teacher_messages(q: Question, solution: str | None = None, feedback: str | None = None) -> list[dict[str, str]]:
    """The question's messages with, after the question, a correct solution and/or the feedback on a failed
    attempt, then the instruction to solve the original question (what a self-teacher sees)."""
    if solution is None and feedback is None:
        raise ValueError("a teacher prompt shows a solution, feedback, or both")
    messages = build_messages(q)
    messages[-1]["content"] = REPROMPT.format(
        question=messages[-1]["content"],
        solution=SOLUTION_SECTION.format(solution=solution) if solution is not None else "",
        feedback=FEEDBACK_SECTION.format(feedback=feedback) if feedback is not None else "",
    )
    return messages


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """Chat-template the messages, ending with the assistant turn's opening.

    Tokenizers without a chat template (raw base checkpoints) get a plain
    transcript, so a model without one still gets a well-formed prompt.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"
