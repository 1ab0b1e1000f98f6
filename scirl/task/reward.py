"""Answer-letter extraction for multiple-choice replies, and the 0/1 reward.

Two extraction modes (and two control rewards built on strict, at the end of this docstring). (SciKnowEval's own
scorer effectively demands a bare letter: it scores "Answer: B" as A.)

- ``strict`` (the training reward): the reply is the letter alone ("B", "(B)", "B.") or its last line
  is "Answer: B" (a final ``\\boxed{B}`` counts as that line). Anything looser is unparsed, so the reward
  also teaches the answer format.
- ``lenient`` (evaluation): reads the forms real models write, in this order, first hit wins:
  1. the whole reply is one letter (lowercase too);
  2. the whole reply is a hedge ("A or C", "A, C", "A/C") -> no answer;
  3. explicit statements ("Answer: B", "the correct option is B", "I would choose B",
     "B is correct"); the LAST one wins, so self-corrections count; one naming several letters is a hedge;
  4. the reply opens with a letter and a delimiter ("B.", "B)", "(B)", "B:", "B - ", "B" on its own line),
     or with "B <text of option B>", or "B, because ..." / "B since ...", unless it walks through the options
     line by line ("A) ...\nB) ...");
  5. "X or Y" anywhere -> no answer; else exactly one distinct letter in reference form
     ("(B)", "B.", "B)", "B:", "B?", or "B" at the very end), not after "not" or a naming noun
     ("vitamin D.", "chain B)"); several -> no answer ("B? Or maybe C.");
  6. exactly one option text appears in the reply (options inside a longer option are not counted twice).

Both modes first normalise the reply: drop ``<think>...</think>``, fold full-width characters (NFKC),
turn ``\\boxed{X}`` and ``<answer>X</answer>`` into "answer: X", drop markdown characters ``*_`#$``, drop
blank lines and turn every run of spaces into one space.
Only the row's labels are answers: "E", or "C" on a two-option row, is never returned.

Control rewards (``[reward] mode``), independent of correctness, for the spurious-reward control run
(Shao et al. 2025, "Spurious Rewards: Rethinking Training Signals in RLVR", arXiv 2506.10947):

- ``format``: 1 when the strict parser reads any of the row's letters, whatever the letter;
- ``random``: 1 with probability 1/2 (the paper's Bernoulli(0.5)), drawn from a key such as
  ``(seed, step, question id, sample index)`` alone, so a resumed run draws the same, whatever the reply.

Their ``Scored`` still carries the strict answer and its correctness, so the control's real accuracy is logged.
"""

from __future__ import annotations

import functools
import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scirl.task.schema import Question

MODES = ("strict", "lenient")  # how a letter is read
CONTROL_MODES = ("random", "format")  # rewards that ignore correctness (read with the strict parser)
REWARD_MODES = (*MODES, *CONTROL_MODES)
RANDOM_REWARD_P = 0.5
DEFAULT_LABELS = ("A", "B", "C", "D")

# ---------------------------------------------------------------------------------------------
# normalisation

_THINK_CLOSE = re.compile(r"</think\s*>", re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think\s*>", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{\s*(?:\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{([^{}]*)\}|([^{}]*))\s*\}")
_ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{([^{}]*)\}")
_LATEX_DELIMS = re.compile(r"\\[()\[\]]")
_MARKDOWN = re.compile(r"[*_`#$]")
_BLANKS = re.compile(r"\s+")  # applied within one line, so never a line break


def strip_think(reply: str) -> str:
    """The reply without its reasoning.

    ``<think>...</think>`` blocks are dropped. When the chat template opened the block itself the reply
    holds only ``</think>``: keep the text after the last one. An unterminated ``<think>`` (the reply was
    cut at max_tokens while still reasoning) leaves nothing: letters in unfinished reasoning are no answer.
    """
    closes = list(_THINK_CLOSE.finditer(reply))
    if closes:
        reply = reply[closes[-1].end() :]
    if _THINK_OPEN.search(reply):
        return ""
    return reply


def _answer_tags(text: str) -> str:
    """Each ``<answer>X</answer>`` (case-insensitive, X stripped) -> "\\nanswer: X\\n", each open tag paired with the
    first close tag after it.

    Done by hand because the regex ``<answer>\\s*(.*?)\\s*</answer>`` is quadratic on unclosed tags: every
    ``<answer>`` scans to the end of the reply for a close tag (an 80 KB reply of open tags took 6 s).
    Here the text is scanned once: once no close tag follows an open tag, none follows any later one.
    """
    parts, pos = [], 0
    while True:
        opened = _ANSWER_OPEN.search(text, pos)
        if opened is None:
            break
        closed = _ANSWER_CLOSE.search(text, opened.end())
        if closed is None:
            break
        parts += [text[pos : opened.start()], "\nanswer: ", text[opened.end() : closed.start()].strip(), "\n"]
        pos = closed.end()
    if not parts:
        return text
    parts.append(text[pos:])
    return "".join(parts)


def normalise(reply: str) -> str:
    """Text that the extraction rules read; see the module docstring."""
    text = unicodedata.normalize("NFKC", strip_think(reply))
    # Boxed and tagged answers are explicit answers: rewrite them as one so that rule 3 (and strict's
    # last-line rule) reads them, and "\boxed{A, C}" becomes a hedge like "answer: A, C".
    text = _BOXED.sub(
        lambda m: "\nanswer: " + (m.group(1) if m.group(1) is not None else m.group(2)).strip() + "\n", text
    )
    text = _answer_tags(text)
    text = _LATEX_TEXT.sub(r"\1", text)
    text = _LATEX_DELIMS.sub(" ", text)
    text = _MARKDOWN.sub("", text)
    # One space per gap: the patterns read "\s*"/"\s+" there anyway, and adjacent whitespace quantifiers
    # ("answer\s*:?\s+", "choose\s+" then "\s*...") split a long run of spaces in quadratically many ways.
    lines = [_BLANKS.sub(" ", line.strip()) for line in text.strip().splitlines()]
    return "\n".join(line for line in lines if line)


# ---------------------------------------------------------------------------------------------
# patterns, compiled once per label set

_OPEN = "[(\\[{\"'\u201c\u2018]"
_CLOSE = "[)\\]}\"'\u201d\u2019]"
# A letter token: one letter, optionally bracketed or quoted, not part of a word, a unit ("5 A"),
# a temperature ("°C"), an abbreviation ("U.S.A.") or a path ("A/C" is handled by the hedge rules).
_BEFORE = r"(?<![A-Za-z0-9_°.'\u2019\\-])(?<!\d )"  # ASCII only: "答案是B" has a letter after a CJK word
_TOKEN = _BEFORE + _OPEN + r"?[A-Za-z]" + _CLOSE + r"?(?![A-Za-z0-9_'\u2019-])"
_SEP = r"(?:\s*[,/&;]\s*(?:(?:and|or)\s+)?|\s+(?:and/or|and|or|&)\s+)"
_SPAN = r"(?P<span>(?i:(?:either|both)\s+)?" + _TOKEN + "(?:" + _SEP + _TOKEN + ")*)"
_CONNECTOR = (
    r"(?:\s*(?:[:=\-\u2013\u2014]|是|为|(?i:is|are|was|would\s+be|should\s+be|must\s+be|will\s+be|be|therefore|thus"
    r"|clearly|likely|probably|definitely|then)\b))*\s*(?:(?i:option|choice|letter)\s*)?"
)
_EXPLICIT_LEADS = (
    r"(?i:\banswers?\b|答案)",
    r"(?i:\b(?:correct|right|best|true|final|appropriate|accurate)\s+(?:one|option|choice|letter|response|statement))",
    r"(?i:\b(?:choose|chose|choosing|select|selected|selecting|pick|picked|picking|go\s+with|going\s+with|opt\s+for))"
    r"\s+(?:(?i:option|choice|answer|letter)\s+)?",
)
_LETTER_FIRST = re.compile(
    r"(?:(?i:\b(?:option|choice|answer)\s+))?(?P<span>" + _TOKEN + r")\s+"
    r"(?i:(?:is|would\s+be|seems\s+to\s+be|appears\s+to\s+be|must\s+be)\s+(?:(?:the|my)\s+)?(?:most\s+)?"
    r"(?:correct|right|answer|best\s+(?:answer|option|choice)|true\s+(?:answer|statement)|(?<=the\s)one)\b)"
)
_EXPLICIT = [re.compile(lead + _CONNECTOR + _SPAN) for lead in _EXPLICIT_LEADS]
_TOKEN_IN_SPAN = re.compile("(?<![A-Za-z])(" + _OPEN + r")?([A-Za-z])(" + _CLOSE + r")?(?![A-Za-z])")
_NEGATED = re.compile(r"(?i:\b(?:not|never)\s+|n't\s+)$")
# After a list of letters, a singular verb starts a new clause ("B, and A is wrong": B is the answer);
# a plural one makes the whole list a subject ("A and C are wrong": no answer here).
_NEW_CLAUSE = re.compile(
    r"\s+(?i:(?P<singular>is|was|isn't|wasn't|can't|cannot|would|does|doesn't|has)|are|were|aren't|weren't|do|don't|have)\b"
)
_DELIMITED = re.compile(r"[.):]|[ \t]*(?:\n|$)")
_WHOLE_LETTER = re.compile(r"^(?i:(?:option|choice|letter)\s*)?" + _OPEN + r"?([A-Za-z])" + _CLOSE + r"?[.:!]?$")
_WHOLE_HEDGE = re.compile(
    r"^(?i:(?:either|both|maybe|possibly|probably|perhaps|answer\s*:?)\s+)?"
    + _TOKEN
    + "(?:"
    + _SEP
    + _TOKEN
    + r")+\s*[.!?]?$"
)
_OPENING = re.compile(
    r"^"
    + _OPEN
    + r"?([A-Za-z])(?:(?P<closed>"
    + _CLOSE
    + r")|(?P<delim>[.:)](?!\d))|(?P<dash>\s+[-\u2013\u2014]\s)|[ \t]*(?:\n|$))"
)
# "C, because A and B are wrong", "C because ...": an upper-case letter, then the reasons for it
_OPENING_REASON = re.compile(r"^" + _OPEN + r"?([A-Z])" + _CLOSE + r"?(?:\s*,)?\s+(?i:because|since|as(?!\s+well))\b")
# Nouns that take a letter as a name, so "vitamin D." or "chain B" is not a reference to an option.
_NAMING_WORDS = frozenset(
    "vitamin vitamins chain chains type class group site fig figure table panel point hepatitis complex phase region"
    " ring domain loop helix strand subunit grade stage schedule form series block zone part section appendix exon"
    " band peak isomer compound molecule mode level state model version coenzyme protein antigen factor"
    " kinase receptor cell cells protease polymerase ion channel atom atoms sample samples species strain".split()
)
# A letter opening a line or a sentence: "A) nucleus\nB) mitochondrion" lists the options, it does not answer.
_ENUMERATED = re.compile(r"(?:^|(?<=[.!?;])[ \t]+)" + _OPEN + r"?([A-Z])(?:" + _CLOSE + r"|[.:)](?!\d))", re.MULTILINE)
_NEGATED_BEFORE = re.compile(r"(?i:\b(?:not|never)|n't)(?:\s+[A-Za-z]+){0,2}\s*$")  # "not A.", "wouldn't pick A."
_LIST_CONTINUES = re.compile(_SEP + _TOKEN)
_PREVIOUS_WORD = re.compile(r"([A-Za-z]+)[ \t]+$")
# "I" then a verb is the pronoun ("the answer is I think B"), not option I of a nine- or ten-option question
_PRONOUN_VERB = re.compile(
    r"\s+(?i:think|believe|guess|suppose|reckon|feel|would|will|am|can|could|should|must|might|need|say|pick|choose"
    r"|go|do|don't|have|hope|suspect|see|know|mean|agree)\b"
)


@dataclass(frozen=True)
class _Patterns:
    labels: tuple[str, ...]
    upper: dict[str, str]  # upper-cased letter -> the row's label
    strict_whole: re.Pattern
    strict_last_line: re.Pattern
    reference: re.Pattern
    hedge_anywhere: re.Pattern


@functools.lru_cache(maxsize=64)
def _patterns(labels: tuple[str, ...]) -> _Patterns:
    if not labels:
        raise ValueError("labels must not be empty")
    for label in labels:
        if not (isinstance(label, str) and len(label) == 1 and label.isalpha()):
            raise ValueError(f"labels must be single letters like 'A', got {label!r} in {labels!r}")
    if len({label.upper() for label in labels}) != len(labels):
        raise ValueError(f"labels must be distinct letters, got {labels!r}")
    letters = "[" + "".join(re.escape(label.upper()) for label in labels) + "]"
    return _Patterns(
        labels=labels,
        upper={label.upper(): label for label in labels},
        strict_whole=re.compile(r"^[(\[]?(" + letters + r")[)\]]?[.:]?$"),
        strict_last_line=re.compile(r"^(?i:answer)\s*:\s*[(\[]?(" + letters + r")[)\]]?\.?$"),
        reference=re.compile(_BEFORE + r"(?:[(\[](" + letters + r")[)\]]|(" + letters + r")(?:[.:)!?](?![\w.])|\s*$))"),
        hedge_anywhere=re.compile(
            _BEFORE
            + r"[(\[]?("
            + letters
            + r")[)\]]?\s*(?:\s(?i:or|and/or)\s|/)\s*[(\[]?("
            + letters
            + r")[)\]]?(?![\w'-])"
        ),
    )


def _check(labels: Sequence[str], mode: str, options: Sequence[str] | None) -> _Patterns:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    pats = _patterns(tuple(labels))
    if options is not None and len(options) != len(pats.labels):
        raise ValueError(f"{len(options)} options for {len(pats.labels)} labels")
    return pats


# ---------------------------------------------------------------------------------------------
# extraction

_NO_ANSWER = ""  # an explicit non-answer (a hedge, a letter outside the labels): stop looking, return None


def extract_answer(
    reply: str | None,
    labels: Sequence[str] = DEFAULT_LABELS,
    mode: str = "lenient",
    options: Sequence[str] | None = None,
) -> str | None:
    """The label the reply chooses, or None (unparsed, a hedge, or a letter that is not a label).

    ``options`` (the option texts, in label order) enables the lenient option-text rules. A reply of None
    (an API message whose content is null, e.g. all of it went to reasoning) is unparsed.
    """
    pats = _check(labels, mode, options)
    if reply is None:
        return None
    if not isinstance(reply, str):
        raise TypeError(f"reply must be a str, got {type(reply).__name__}")
    text = normalise(reply)
    if not text:
        return None
    if mode == "strict":
        return _strict(text, pats)
    found = _lenient(text, pats, options)
    return found or None


def _strict(text: str, pats: _Patterns) -> str | None:
    m = pats.strict_whole.match(text) or pats.strict_last_line.match(text.rsplit("\n", 1)[-1])
    return pats.upper[m.group(1)] if m else None


def _lenient(text: str, pats: _Patterns, options: Sequence[str] | None) -> str | None:
    # 1. the whole reply is one letter
    m = _WHOLE_LETTER.match(text)
    if m:
        return pats.upper.get(m.group(1).upper(), _NO_ANSWER)
    # 2. the whole reply offers several letters
    if _WHOLE_HEDGE.match(text):
        return _NO_ANSWER
    # 3. explicit statements: the last one wins
    found = _explicit(text, pats)
    if found is not None:
        return found
    # 4. opens with a letter and a delimiter, or with a letter and its option text
    found = _opening(text, pats, options)
    if found is not None:
        return found
    # 5. a hedge anywhere, else exactly one letter in reference form
    if any(m.group(1) != m.group(2) for m in pats.hedge_anywhere.finditer(text)):
        return _NO_ANSWER
    found = _references(text, pats)
    if found is not None:
        return found
    # 6. the text of exactly one option
    if options is not None:
        return _option_text(text, pats, options)
    return None


def _is_token_valid(text: str, end: int, letter: str, wrapped: bool, pats: _Patterns) -> bool:
    """A letter after "answer is" counts if it is one of the labels in upper case, or if it is marked as a
    letter (bracketed, or followed by '.', ')', ':' or the end of the line). This keeps "the answer is a
    protein" and "the answer is I think B" from reading as letters, also where "I" is a label (nine or ten options)."""
    if wrapped or _DELIMITED.match(text, end):
        return True
    if letter == "I" and _PRONOUN_VERB.match(text, end):
        return False
    return letter.isupper() and letter in pats.upper


def _span_result(text: str, span_start: int, span: str, pats: _Patterns) -> str | None:
    """What one explicit statement says: a label, _NO_ANSWER (hedge or out-of-set letter), or None (not a letter)."""
    letters: list[str] = []
    for i, tok in enumerate(_TOKEN_IN_SPAN.finditer(span)):
        open_, letter, close = tok.groups()
        end = span_start + tok.end()
        if not _is_token_valid(text, end - bool(close), letter, bool(open_ and close), pats):
            if i == 0:
                return None
            break
        clause = _NEW_CLAUSE.match(text, end) if i > 0 else None
        if clause:
            if not clause.group("singular"):
                return None
            break
        letters.append(letter.upper())
    if not letters:
        return None
    if len(set(letters)) > 1:
        return _NO_ANSWER
    return pats.upper.get(letters[0], _NO_ANSWER)


def _explicit(text: str, pats: _Patterns) -> str | None:
    last_pos, last = -1, None
    for pattern in (*_EXPLICIT, _LETTER_FIRST):
        for m in pattern.finditer(text):
            if pattern is not _LETTER_FIRST and _NEGATED.search(text[max(0, m.start() - 16) : m.start()]):
                continue  # "I would not choose A"
            result = _span_result(text, m.start("span"), m.group("span"), pats)
            if result is not None and m.start("span") > last_pos:
                last_pos, last = m.start("span"), result
    return last


def _opening(text: str, pats: _Patterns, options: Sequence[str] | None) -> str | None:
    if len({e.group(1) for e in _ENUMERATED.finditer(text)}) > 1:
        return None  # the reply walks through the options one by one
    m = _OPENING.match(text)
    if m:
        letter = m.group(1)
        if _LIST_CONTINUES.match(text, m.end(1) + len(m.group("closed") or "")):
            return _NO_ANSWER  # "(A) and (C) are both right"
        if letter.upper() in pats.upper and (letter.isupper() or not m.group("dash")):
            return pats.upper[letter.upper()]
        if letter.isupper() and letter not in pats.upper and "A" <= letter <= "F":
            return _NO_ANSWER  # "E. none of these", or "C)" on a two-option row
    m = _OPENING_REASON.match(text)
    if m and m.group(1) in pats.upper:
        return pats.upper[m.group(1)]
    if options is not None:
        # "B mitochondrion": a letter, a space and that option's text
        m = re.match(r"^" + _OPEN + r"?([A-Za-z])" + _CLOSE + r"?\s+", text)
        if m and m.group(1).upper() in pats.upper:
            option = _fold(options[pats.labels.index(pats.upper[m.group(1).upper()])])
            rest = _fold(text[m.end() :])
            if option and rest.startswith(option) and not rest[len(option) : len(option) + 1].isalnum():
                return pats.upper[m.group(1).upper()]
    return None


def _references(text: str, pats: _Patterns) -> str | None:
    letters = set()
    for m in pats.reference.finditer(text):
        before = text[max(0, m.start() - 40) : m.start()]
        previous = _PREVIOUS_WORD.search(before)
        if previous and previous.group(1).lower() in _NAMING_WORDS:
            continue  # "vitamin D.", "chain B)"
        if _NEGATED_BEFORE.search(before):
            continue  # "not A.", "I would not choose A."
        letters.add(m.group(1) or m.group(2))
    if len(letters) == 1:
        return pats.upper[letters.pop()]
    return _NO_ANSWER if letters else None


_SPACES = re.compile(r"\s+")


def _fold(s: str) -> str:
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", s)).strip().casefold()


def _option_text(text: str, pats: _Patterns, options: Sequence[str]) -> str | None:
    """Exactly one option (of 3+ characters) named in the reply. Longer options are matched first and
    blanked out, so "MHC class II" does not also count as "MHC class I"."""
    haystack = _fold(text)
    named = set()
    for index in sorted(range(len(options)), key=lambda i: -len(_fold(options[i]))):
        option = _fold(options[index])
        if len(option) < 3:
            continue
        pattern = re.compile(
            ("(?<!\\w)" if option[0].isalnum() else "")
            + re.escape(option)
            + ("(?!\\w)" if option[-1].isalnum() else "")
        )
        if pattern.search(haystack):
            named.add(pats.labels[index])
            haystack = pattern.sub("\0", haystack)
    return named.pop() if len(named) == 1 else None


# ---------------------------------------------------------------------------------------------
# reward and scoring


@dataclass(frozen=True)
class Scored:
    answer: str | None  # the extracted label, None when unparsed
    correct: bool
    parsed: bool  # False: no answer could be read (counted apart from wrong answers)
    reward: float


def score(reply: str | None, question: Question, mode: str, *, draw: tuple = ()) -> Scored:
    """Extract, compare with the question's answer key, and say whether anything was parsed at all.

    ``mode`` is one of ``REWARD_MODES``; the controls read the reply with the strict parser and reward
    apart from correctness. ``draw``: the key of ``random``'s coin (e.g. ``(seed, step, question id, sample)``)."""
    if mode not in REWARD_MODES:
        raise ValueError(f"mode must be one of {REWARD_MODES}, got {mode!r}")
    answer = extract_answer(reply, question.labels, "strict" if mode in CONTROL_MODES else mode, question.options)
    correct = answer is not None and answer == question.answer_key
    if mode == "random":
        value = random_reward(*draw)
    elif mode == "format":
        value = 1.0 if answer is not None else 0.0
    else:
        value = 1.0 if correct else 0.0
    return Scored(answer=answer, correct=correct, parsed=answer is not None, reward=value)


def failure_feedback(scored: Scored, mode: str, truncated: bool) -> str | None:
    """What the reward can tell a failed reply about why it failed (a self-teacher's prompt shows it): that no
    answer letter could be read in it, and whether it was cut off first. A wrong letter gets none: the reward
    says only that it is wrong, and naming the right one would hand the teacher the answer; ``random``'s coin
    says nothing about the reply."""
    if scored.parsed or mode == "random":
        return None
    if truncated:
        return "Your reply was cut off at the length limit before it gave an answer."
    return "No answer letter could be read in your reply: give the letter alone, or end with a line 'Answer: X'."


def random_reward(*key: object) -> float:
    """The ``random`` control's reward: 1.0 with probability ``RANDOM_REWARD_P``, from ``key`` alone."""
    if not key:
        raise ValueError("the random reward needs a key (seed, step, question id, sample index) to be reproducible")
    return 1.0 if random.Random("-".join(str(part) for part in ("reward", *key))).random() < RANDOM_REWARD_P else 0.0
