"""The prompt is shared by evaluation, training and the prime-rl plug-in; its shape is part of the contract."""

from scirl.cli import main as cli_main
from scirl.synth.questions import generate_rows
from scirl.task.data import question_from_row
from scirl.task.prompt import build_messages, default_instruction, render_prompt


def first_question(n_options=4):
    rows = [r for r in generate_rows(20, seed=1, non_mcq=False) if r["type"] == f"mcq-{n_options}-choices"]
    return question_from_row(rows[0], source="t:0")


def test_messages_use_row_instruction_then_question_and_lettered_options():
    q = first_question()
    system, user = build_messages(q)
    assert system == {"role": "system", "content": q.raw["prompt"]["default"]}
    assert user["role"] == "user"
    lines = user["content"].split("\n")
    assert lines[0] == q.question and lines[1] == ""
    assert lines[2:] == [f"{label}. {text}" for label, text in zip(q.labels, q.options)]


def test_missing_instruction_gets_a_default_naming_the_row_labels():
    row = dict(generate_rows(4, seed=2, non_mcq=False)[0])
    row.pop("prompt")
    q = question_from_row(row)
    system = build_messages(q)[0]["content"]
    assert '"A", "B", "C" or "D"' in system and "four options" in system
    assert default_instruction(("A", "B")).count('"') == 4 and "two options" in default_instruction(("A", "B"))


def test_render_prompt_without_chat_template_ends_with_assistant_turn():
    class Bare:
        chat_template = None

    text = render_prompt(Bare(), build_messages(first_question()))
    assert text.endswith("Assistant:") and "System:" in text


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("data", "eval", "serve", "train", "demo", "report", "export"):
        assert name in out
    assert cli_main(["frobnicate"]) == 2


def test_default_instruction_counts_up_to_ten_options():
    ten = tuple("ABCDEFGHIJ")
    assert default_instruction(ten).startswith("Given a question and ten options,")
    assert 'Your answer should be "A", "B", "C", "D", "E", "F", "G", "H", "I" or "J".' in default_instruction(ten)
    assert default_instruction(("A", "B", "C")).startswith("Given a question and three options,")
    assert 'should be "A", "B", "C", "D" or "E".' in default_instruction(tuple("ABCDE"))
