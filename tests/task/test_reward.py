"""Answer extraction and reward: a table of realistic replies, then properties over generated rows."""

from __future__ import annotations

import random

import pytest

from scirl.synth.questions import generate_rows
from scirl.task.data import question_from_row
from scirl.task.reward import MODES, Scored, extract_answer, score, strip_think

FOUR = ("A", "B", "C", "D")
FOUR_OPTIONS = ("nucleus", "mitochondrion", "ribosome", "lysosome")
TWO = ("A", "B")
TWO_OPTIONS = ("hydrolysis", "oxidation")

# (reply, lenient, strict); four options A nucleus, B mitochondrion, C ribosome, D lysosome.
FOUR_CASES = [
    # bare letters, with punctuation, brackets, markdown, case, full-width forms
    ("B", "B", "B"),
    ("B.", "B", "B"),
    ("B)", "B", "B"),
    ("(B)", "B", "B"),
    ("[B]", "B", "B"),
    ("B:", "B", "B"),
    ("**B**", "B", "B"),
    ("`B`", "B", "B"),
    ("**(B)**", "B", "B"),
    ("### B", "B", "B"),
    (" B \n", "B", "B"),
    ("B\n", "B", "B"),
    ("Ｂ", "B", "B"),
    ("（B）", "B", "B"),
    ("b", "B", None),
    ("(b)", "B", None),
    ("b.", "B", None),
    ("'B'", "B", None),
    ('"B"', "B", None),
    ("{B}", "B", None),
    ("B!", "B", None),
    ("Option B", "B", None),
    ("option b", "B", None),
    ("A", "A", "A"),
    ("A.", "A", "A"),
    ("D", "D", "D"),
    ("E", None, None),
    ("e", None, None),
    ("I", None, None),
    ("", None, None),
    ("   ", None, None),
    ("\n\n", None, None),
    # explicit statements
    ("Answer: B", "B", "B"),
    ("**Answer:** B", "B", "B"),
    ("ANSWER: B", "B", "B"),
    ("answer: B", "B", "B"),
    ("answer : B", "B", "B"),
    ("Answer:C", "C", "C"),
    ("Answer: (C)", "C", "C"),
    ("Answer: [C]", "C", "C"),
    ("Answer: C.", "C", "C"),
    ("Answer: B)", "B", "B"),
    ("Final Answer: D", "D", None),
    ("答案：B", "B", None),
    ("答案是B", "B", None),
    ("Answer: b", "B", None),
    ("answer: a", "A", None),
    ("Answer - B", "B", None),
    ("Answer:\nC", "C", None),
    ("Answer: B. mitochondrion", "B", None),
    ("My answer: C", "C", None),
    ("Correct answer: D", "D", None),
    ("Selected answer: B", "B", None),
    ("The answer is B.", "B", None),
    ("the answer is b.", "B", None),
    ("THE ANSWER IS C", "C", None),
    ("The answer is (B) mitochondrion", "B", None),
    ("The answer is: C) ribosome", "C", None),
    ("The answer would be (A).", "A", None),
    ("Based on the sequence, the answer should be C.", "C", None),
    ("The correct option is B", "B", None),
    ("The correct answer is: **B**", "B", None),
    ("The correct answer is B. mitochondrion", "B", None),
    ("My final answer is option B.", "B", None),
    ("The right one is C.", "C", None),
    ("Correct choice: A", "A", None),
    ("The best choice is D, because lysosomes digest cellular waste.", "D", None),
    ("I would choose C", "C", None),
    ("I'd go with D.", "D", None),
    ("I select option A.", "A", None),
    ("I choose (d).", "D", None),
    ("I choose d", "D", None),
    ("Option C is correct.", "C", None),
    ("Option C is the correct answer.", "C", None),
    ("(D) is the right answer.", "D", None),
    ("(B) is my answer.", "B", None),
    ("Looking at the options, C is the one.", "C", None),
    ("Option A is incorrect. Option B is incorrect. Option C is correct. Option D is incorrect.", "C", None),
    ("Therefore B", "B", None),
    ("Therefore, B.", "B", None),
    ("So, (C).", "C", None),
    ("I think it's B.", "B", None),
    ("Option B.", "B", None),
    # self-corrections: the last statement wins
    ("Answer: A\nActually, the answer is C", "C", None),
    ("Answer: A\nWait, let me reconsider.\nAnswer: C", "C", "C"),
    ("The answer is C.\n\nAnswer: C", "C", "C"),
    ("Therefore, the answer is B.\nB", "B", None),
    # negations and letters that are not answers
    ("The answer is not A; it is C.", "C", None),
    ("I would not choose A. The answer is D.", "D", None),
    ("I wouldn't pick A; I'd choose B.", "B", None),
    ("The answer is I think B", "B", None),
    ("I would not choose A.", None, None),
    ("Not A. B.", "B", None),
    ("It is not (C).", None, None),
    ("(A) and (B) are both correct.", None, None),
    ("A, C and D are wrong; B.", "B", None),
    ("Answers A and C are wrong, so B.", "B", None),
    ("The answers are A and C.", None, None),
    ("In this case, B.", "B", None),
    ("Hmm, B? Or maybe C.", None, None),
    ("Is it B? Yes, B.", "B", None),
    ("It's B!", "B", None),
    ("I'm not sure, but I'd say B.", "B", None),
    ("C is incorrect; the answer must be B.", "B", None),
    ("I believe the correct response is B.", "B", None),
    ("Correct Answer: B\nIncorrect: A, C, D", "B", None),
    ("The answer is B.\n\nHowever, if the protein were secreted, the answer could be C.", "B", None),
    ("Answer: The mitochondrion (B)", "B", None),
    ("Among the options, (B) mitochondrion is correct.", "B", None),
    ("Let's evaluate:\nA) Incorrect.\nB) Correct.\nC) Incorrect.\nD) Incorrect.\n\nSo the answer is B.", "B", None),
    ("Let's evaluate:\nA) Incorrect.\nB) Correct.\nC) Incorrect.\nD) Incorrect.", None, None),
    ("A. The nucleus is wrong. B. The mitochondrion is right.", None, None),
    ("B.\n\nThe other options: A. nucleus is where DNA is, C. ribosome, D. lysosome.", "B", None),
    ("None of the options are correct.", None, None),
    ("All of the above", None, None),
    ("The answer is a protein kinase.", None, None),
    ("Answer: E", None, None),
    ("The answer is E.", None, None),
    ("\\boxed{E}", None, None),
    # reasoning before a final line
    ("Let me think. Mitochondria make ATP.\nAnswer: B", "B", "B"),
    ("Reasoning: A and C are wrong because neither makes ATP.\nAnswer: B", "B", "B"),
    ("A) nucleus\nB) mitochondrion\nC) ribosome\nD) lysosome\nAnswer: B", "B", "B"),
    ("Answer: B\n\nExplanation: A is the nucleus, C is the ribosome and D is the lysosome.", "B", None),
    ("The answer is B because the mitochondrion makes ATP, not A (nucleus) or C (ribosome).", "B", None),
    ("The answer is B; C is a distractor.", "B", None),
    ("The answer is B, and A is wrong.", "B", None),
    ("Answer: B, A is wrong", "B", None),
    # <think> blocks: the letters inside are ignored
    ("<think>The nucleus (A) stores DNA; the ribosome (C) makes protein.</think>\nB", "B", "B"),
    ("<think>Maybe D. Or C.</think> B", "B", "B"),
    ("<think>\nThe answer is D.\n</think>\n\nThe answer is B.", "B", None),
    ("<think>A...</think><think>still C</think>D", "D", "D"),
    ("<THINK>C.</THINK>A", "A", "A"),
    ("Let me consider A and D... </think>\n\nAnswer: C", "C", "C"),
    ("The answer is D.</think>B", "B", "B"),
    ("</think>B", "B", "B"),
    ("<think>I think it is B, but", None, None),
    ("<think>Answer: D.\nHmm, maybe", None, None),
    ("<think>D.</think>", None, None),
    ("<think>D.</think>   \n", None, None),
    # \boxed and answer tags
    ("\\boxed{B}", "B", "B"),
    ("$\\boxed{\\text{C}}$", "C", "C"),
    ("\\boxed{\\textbf{(C)}}", "C", "C"),
    ("The answer is $\\boxed{D}$.", "D", None),
    ("Therefore, \\(\\boxed{B}\\)", "B", "B"),
    ("The mitochondrion makes ATP.\n\\[\\boxed{B}\\]", "B", "B"),
    ("\\boxed{A, C}", None, None),
    ("<answer>B</answer>", "B", "B"),
    ("<think>C or D?</think><answer> D </answer>", "D", "D"),
    # a letter followed by its option text or an explanation that names other letters
    ("B. mitochondrion", "B", None),
    ("B) mitochondrion", "B", None),
    ("(B) mitochondrion", "B", None),
    ("B - mitochondrion", "B", None),
    ("B – mitochondrion", "B", None),
    ("B: mitochondrion", "B", None),
    ("B mitochondrion", "B", None),
    ("**B. mitochondrion**", "B", None),
    ("b. mitochondrion", "B", None),
    ("A. nucleus", "A", None),
    ("B. Unlike A and C, it makes ATP.", "B", None),
    ("B. Mitochondrion. The other options (A) nucleus, (C) ribosome and (D) lysosome do not make ATP.", "B", None),
    ("C. Ribosome\n\nA is wrong because the nucleus stores DNA; B and D are other organelles.", "C", None),
    ("D\n\nThe lysosome. Not A, B or C.", "D", None),
    ("A\nThe nucleus holds the chromosomes, unlike B or C.", "A", None),
    # a letter, then a comma or "because" and the reasons (naming other letters)
    ("C, because A and B are wrong", "C", None),
    ("C, because the ribosome translates mRNA.", "C", None),
    ("C because A is wrong", "C", None),
    ("B, since A and C make no ATP.", "B", None),
    ("B, as the mitochondrion makes ATP", "B", None),
    ("A, B and C are all wrong, so D", "D", None),
    ("A, C and D are incorrect", None, None),
    ("A, as well as C, binds it", None, None),
    ("B. mitochondrion. Option A (nucleus) is tempting but wrong.", "B", None),
    # a sentence that opens with the article "A"
    ("A protein that localizes to the mitochondrion, so the answer is B.", "B", None),
    ("A mitochondrial targeting sequence is present, so B.", "B", None),
    ("A careful reading points to the ribosome. Answer: C", "C", None),
    ("A careful reading points to the ribosome.\nAnswer: C", "C", "C"),
    ("A nuclear localization signal is absent; the correct option is D", "D", None),
    ("A good choice here is C.", "C", None),
    ("A lysosome.", "D", None),
    ("A ribosome", "C", None),
    ("A protein kinase phosphorylates the substrate in the lysosome, so D", "D", None),
    # hedges get no answer
    ("A and C", None, None),
    ("A, C", None, None),
    ("B or D", None, None),
    ("A/C", None, None),
    ("a or c", None, None),
    ("Either B or D.", None, None),
    ("Both A and C", None, None),
    ("(A) and (C)", None, None),
    ("The answer is A or C.", None, None),
    ("Answer: B, D", None, None),
    ("Answer: B/D", None, None),
    ("The answer is either B or D.", None, None),
    ("It could be B or D.", None, None),
    ("I think B/D.", None, None),
    ("Not B or B; it is A or C.", None, None),
    ("A, B, C and D are all plausible.", None, None),
    ('Your answer should be "A", "B", "C" or "D".', None, None),
    ("A or C. Final answer: C", "C", None),
    ("Answer: A or C\nActually, the answer is C", "C", None),
    # reasoning that names every letter, echoed options, truncated replies
    ("A: nucleus - no. B: mitochondrion - yes. C: ribosome - no. D: lysosome - no.", None, None),
    ("A) nucleus\nB) mitochondrion\nC) ribosome\nD) lysosome", None, None),
    ("Option A: wrong. Option B: right.", None, None),
    ("Let me analyze each option. A is the nucleus, B is the mitochondrion, and", None, None),
    ("The options are (A) and (B), and the", None, None),
    # letters that are units, symbols and names, not answers
    ("The current is 5 A.", None, None),
    ("It melts at 100 °C.", None, None),
    ("Vitamin D.", None, None),
    ("It binds chain B.", None, None),
    ("See Fig. 2C and the 3D structure.", None, None),
    ("Vitamin B12 deficiency", None, None),
    ("This is a type C lectin.", None, None),
    ("It's in the U.S.A.", None, None),
    ("The C-terminal tail is cleaved", None, None),
    ("The answer relates to vitamin D, so the right option is C.", "C", None),
    ("B12 is a vitamin; the answer is C", "C", None),
    ("Its 3D structure resembles a ribosome, so C.", "C", None),
    ("A 5 A current flows; hence D", "D", None),
    ("The protein localizes to the mitochondrion (B).", "B", None),
    # the option text alone
    ("mitochondrion", "B", None),
    ("The mitochondrion.", "B", None),
    ("It localizes to the Mitochondrion", "B", None),
    ("Lysosome", "D", None),
    ("nucleus or ribosome", None, None),
    ("Not the nucleus; the ribosome.", None, None),
    ("It localizes to the mitochondria", None, None),
    ("I don't know.", None, None),
]

# (reply, lenient, strict); two options A hydrolysis, B oxidation: C and D are not answers.
TWO_CASES = [
    ("B", "B", "B"),
    ("A.", "A", "A"),
    ("Answer: B", "B", "B"),
    ("The answer is B", "B", None),
    ("A. hydrolysis", "A", None),
    ("oxidation", "B", None),
    ("Answer: a", "A", None),
    ("C", None, None),
    ("(D)", None, None),
    ("Answer: C", None, None),
    ("The answer is D.", None, None),
    ("C. oxidation", None, None),
    ("A or B", None, None),
    ("Answer: A or B", None, None),
    ("<think>C? D?</think>B", "B", "B"),
    ("\\boxed{C}", None, None),
    ("The first sequence (A) keeps the active site, so the answer is A.", "A", None),
]


def _ids(cases):
    return [repr(reply)[:60] for reply, _, _ in cases]


@pytest.mark.parametrize("reply,lenient,strict", FOUR_CASES, ids=_ids(FOUR_CASES))
def test_four_option_replies(reply, lenient, strict):
    assert extract_answer(reply, FOUR, "lenient", FOUR_OPTIONS) == lenient
    assert extract_answer(reply, FOUR, "strict", FOUR_OPTIONS) == strict


@pytest.mark.parametrize("reply,lenient,strict", TWO_CASES, ids=_ids(TWO_CASES))
def test_two_option_replies(reply, lenient, strict):
    assert extract_answer(reply, TWO, "lenient", TWO_OPTIONS) == lenient
    assert extract_answer(reply, TWO, "strict", TWO_OPTIONS) == strict


def test_table_is_large_and_covers_both_outcomes():
    cases = FOUR_CASES + TWO_CASES
    assert len(cases) >= 150
    assert sum(lenient is None for _, lenient, _ in cases) >= 30
    assert sum(strict is not None for _, _, strict in cases) >= 30


def test_option_text_rules_need_options():
    assert extract_answer("mitochondrion", FOUR, "lenient") is None
    assert extract_answer("B mitochondrion", FOUR, "lenient") is None
    assert extract_answer("B mitochondrion", FOUR, "lenient", FOUR_OPTIONS) == "B"


def test_option_inside_a_longer_option_is_not_counted_twice():
    options = ("MHC class I", "MHC class II", "CD4", "CD8")
    assert extract_answer("It is presented on MHC class II molecules.", FOUR, "lenient", options) == "B"
    assert extract_answer("It is presented on MHC class I molecules.", FOUR, "lenient", options) == "A"
    assert extract_answer("Either MHC class I or MHC class II.", FOUR, "lenient", options) is None


@pytest.mark.parametrize(
    "reply,expected",
    [
        ("<think>A</think>B", "B"),
        ("reasoning</think>B", "B"),
        ("x</think>y</think>z", "z"),
        ("<think>cut off", ""),
        ("no reasoning at all", "no reasoning at all"),
    ],
)
def test_strip_think(reply, expected):
    assert strip_think(reply) == expected


def test_reward_is_one_only_for_the_answer_key():
    q = _questions()[0]
    key = q.answer_key
    other = next(label for label in q.labels if label != key)
    assert score(key, q, "strict").reward == 1.0
    assert score(other, q, "strict").reward == 0.0
    assert score("", q, "strict").reward == 0.0
    assert score(f"The answer is {key}.", q, "strict").reward == 0.0  # strict: the format is part of the reward
    assert score(f"The answer is {key}.", q, "lenient").reward == 1.0
    assert extract_answer("Answer: B", TWO) == "B"
    assert extract_answer("Answer: C", TWO) is None  # C is not a label of a two-option row


def _questions(n_per_domain=12, seed=0):
    rows = [r for r in generate_rows(n_per_domain=n_per_domain, seed=seed) if r["type"].startswith("mcq")]
    return [question_from_row(r) for r in rows]


def test_score_separates_wrong_from_unparsed():
    q = next(q for q in _questions() if len(q.labels) == 4)
    wrong = next(label for label in q.labels if label != q.answer_key)
    assert score(f"Answer: {q.answer_key}", q, "strict") == Scored(
        answer=q.answer_key, correct=True, parsed=True, reward=1.0
    )
    assert score(f"Answer: {wrong}", q, "strict") == Scored(answer=wrong, correct=False, parsed=True, reward=0.0)
    assert score("I am not sure.", q, "strict") == Scored(answer=None, correct=False, parsed=False, reward=0.0)
    correct_text = q.options[q.labels.index(q.answer_key)]
    assert score(f"It is {correct_text}.", q, "lenient").correct
    assert not score(f"It is {correct_text}.", q, "strict").parsed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_label_in_every_form_extracts_to_that_label(seed):
    """For random option sets, each label written in the common answer forms reads back as itself."""
    rng = random.Random(seed)
    for q in _questions(seed=seed):
        for label, text in zip(q.labels, q.options):
            others = [x for x in q.labels if x != label]
            thinking = f"<think>{rng.choice(others)}. looks wrong; ({rng.choice(others)}) too.</think>"
            for reply, strict_too in [
                (f"Answer: {label}", True),
                (label, True),
                (f"({label})", True),
                (f"{thinking}\n{label}", True),
                (f"Some reasoning about {rng.choice(q.options)}.\nAnswer: {label}", True),
                (f"{label}. {text}", False),
                (f"({label}) {text}", False),
                (f"{label} - {text}", False),
                (f"the answer is {label.lower()}.", False),
                (f"The correct option is {label}, because the others ({', '.join(others)}) do not fit.", False),
                (f"\\boxed{{{label}}}", True),
                (f"A careful look at {rng.choice(q.options)} settles it, so the answer is {label}.", False),
                (f"{label}. {text}\n\nThe other options ({', '.join(others)}) do not fit.", False),
                (f"{label}\n\n" + " ".join(f"{o} is wrong." for o in others), False),
                (f"A {text}.", False),
            ]:
                assert extract_answer(reply, q.labels, "lenient", q.options) == label, reply
                assert extract_answer(reply, q.labels, "strict", q.options) == (label if strict_too else None), reply
            # the option text alone, when no other option's text is inside it
            if not any(o != text and o.lower() in text.lower() for o in q.options):
                assert extract_answer(text, q.labels, "lenient", q.options) == label
            assert score(f"Answer: {label}", q, "strict").reward == float(label == q.answer_key)


def test_two_different_letters_are_a_hedge_in_every_form():
    for a in FOUR:
        for b in FOUR:
            if a == b:
                continue
            for reply in (
                f"{a} or {b}",
                f"{a}, {b}",
                f"{a}/{b}",
                f"{a} and {b}",
                f"The answer is {a} or {b}.",
                f"Answer: {a}, {b}",
                f"It is either {a} or {b}.",
            ):
                assert extract_answer(reply, FOUR, "lenient", FOUR_OPTIONS) is None, reply
                assert extract_answer(reply, FOUR, "strict", FOUR_OPTIONS) is None, reply


def test_random_text_only_ever_yields_a_label_or_none_and_strict_agrees_with_lenient():
    rng = random.Random(0)
    pieces = [
        "A",
        "B",
        "C",
        "D",
        "E",
        "a",
        "b",
        " ",
        ".",
        ")",
        "(",
        ":",
        "\n",
        "answer",
        "is",
        "or",
        "the",
        "<think>",
        "</think>",
        "\\boxed{",
        "}",
        "**",
        "option",
        "nucleus",
        "ribosome",
        ",",
        "5",
        "°",
        "答案",
        "：",
        "Ｂ",
        "$",
        "/",
        "'",
        "-",
        "not",
        "choose",
        "correct",
        "vitamin",
    ]
    for _ in range(2000):
        reply = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for labels, options in ((FOUR, FOUR_OPTIONS), (TWO, TWO_OPTIONS)):
            lenient = extract_answer(reply, labels, "lenient", options)
            strict = extract_answer(reply, labels, "strict", options)
            assert lenient in (*labels, None) and strict in (*labels, None)
            assert strict is None or lenient == strict, reply  # strict reads a subset of what lenient reads


def test_strict_answers_are_lenient_answers():
    """Whatever strict mode reads, lenient mode reads the same way (strict is the narrower format)."""
    for reply, _, strict in FOUR_CASES:
        if strict is not None:
            assert extract_answer(reply, FOUR, "lenient", FOUR_OPTIONS) == strict, reply


def test_bad_arguments_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="mode"):
        extract_answer("B", FOUR, "fuzzy")
    with pytest.raises(ValueError, match="single letters"):
        extract_answer("B", ("A", "BB"))
    with pytest.raises(ValueError, match="distinct"):
        extract_answer("B", ("A", "a"))
    with pytest.raises(ValueError, match="options"):
        extract_answer("B", FOUR, "lenient", ("x", "y"))
    with pytest.raises(TypeError, match="str"):
        extract_answer(b"B", FOUR)  # type: ignore[arg-type]


def test_a_null_reply_is_unparsed():
    q = _questions()[0]
    assert extract_answer(None, FOUR) is None
    assert score(None, q, "lenient") == Scored(answer=None, correct=False, parsed=False, reward=0.0)


# ---- extraction is linear in the reply's length (issue 12, item 8) ----

ADVERSARIAL = {
    # each was quadratic (or worse): 80 KB of unclosed <answer> tags took 6 s, 240 KB 55 s
    "unclosed answer tags": "<answer>",
    "spaces after answer": "answer" + " " * 64,
    "tabs after a choice": "I choose" + "\t" * 64 + ".",
    "latex delimiters after answer": "answer" + "\\(" * 64,
    "boxed opens": "\\boxed{",
    "think opens": "<think>",
    "bracketed letters": "(A)",
    "hedged letters": "A or ",
    "slash letters": "/A",
    "explicit statements": "the answer is B. ",
    "negations": "not ",
    "enumerated options": "A) x\n",
}


@pytest.mark.timeout(120)  # linear: well under a second on a loaded machine; quadratic: hours
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_a_megabyte_of_adversarial_reply_is_read_in_linear_time(name):
    unit = ADVERSARIAL[name]
    reply = ("answer" if name != "spaces after answer" else "") + unit * (1_000_000 // len(unit)) + "x"
    for mode in MODES:
        extract_answer(reply, FOUR, mode, FOUR_OPTIONS)  # the result does not matter, finishing does


def test_answer_tags_are_read_as_the_regex_read_them():
    """The hand-written <answer> pass gives what ``<answer>\\s*(.*?)\\s*</answer>`` (DOTALL, any case) gave."""
    import random
    import re

    from scirl.task.reward import _answer_tags

    old = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.IGNORECASE | re.DOTALL)
    pieces = ["<answer>", "</answer>", "<ANSWER>", "</Answer>", " ", "\n", "B", "text", "<answer", "answer>"]
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert _answer_tags(text) == old.sub(lambda m: "\nanswer: " + m.group(1) + "\n", text), text


def test_runs_of_spaces_read_as_one():
    assert extract_answer("Answer:      B", FOUR, "strict") == "B"
    assert extract_answer("I would   choose \t  (C)", FOUR, "lenient") == "C"
    assert extract_answer("<answer>   D  </answer>", FOUR, "strict") == "D"


TEN = tuple("ABCDEFGHIJ")


@pytest.mark.parametrize(
    "reply, lenient, strict",
    [
        ("J", "J", "J"),
        ("Answer: J", "J", "J"),
        ("(H)", "H", "H"),
        ("The correct option is I.", "I", None),
        ("answer: I", "I", "I"),
        ("I", "I", "I"),
        # "I" followed by a verb is the pronoun, even where I is an option
        ("the answer is I think B", "B", None),
        ("I think the answer is J.", "J", None),
        ("I would choose G", "G", None),
        ("\\boxed{F}", "F", "F"),
        ("Answer: K", None, None),  # not a label
    ],
)
def test_ten_option_questions_read_letters_up_to_j(reply, lenient, strict):
    assert extract_answer(reply, TEN, "lenient") == lenient
    assert extract_answer(reply, TEN, "strict") == strict


@pytest.mark.parametrize(
    "labels, reply, expected",
    [
        (("A", "B"), "B", "B"),
        (("A", "B"), "C", None),
        (("A", "B"), "Answer: C", None),
        (("A", "B", "C"), "C", "C"),
        (("A", "B", "C"), "D", None),
        (("A", "B", "C"), "Answer: C", "C"),
        (tuple("ABCDE"), "E", "E"),
        (tuple("ABCDE"), "Answer: E", "E"),
        (tuple("ABCDE"), "F", None),
    ],
)
def test_two_three_and_five_option_questions_take_only_their_letters(labels, reply, expected):
    assert extract_answer(reply, labels, "lenient") == expected
    assert extract_answer(reply, labels, "strict") == expected
