"""Final answers and how they compare: the helpers behind the built-in verifiable rewards ``exact``, ``numeric``
and ``math`` (``dora.tasks.rewards``).

The same extraction reads the completion and the reference answer (``Item.answer``), so a reference may be a
bare answer ("42") or a worked solution ("47 + 38 = 85\\n#### 85"). The final answer of a text is, in order:

1. the content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced, nested ones kept;
   ``\\{`` and ``\\}`` are literal braces, not grouping);
2. else the first line after the last ``####`` (GSM8K's layout);
3. else the first line after the last ``=`` (the arithmetic task's ``a+b=`` prompts);
4. else the last line that is not blank.

An empty final answer matches nothing. A reference with no final answer (or, for ``numeric``, one that is
not a number) raises ``ValueError``: a reward that fails says why (``rewards.score``), where a quiet 0 would
hide a dataset that does not fit the reward.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from fractions import Fraction
from typing import Any

REL_TOL = Fraction(1, 10**6)
"""``numeric``: two numbers that are not both integers agree within this relative tolerance."""
MAX_MATH_CHARS = 1000
"""``math``: a longer final answer of a completion scores 0 unread (sympy on a huge expression can run for
minutes, and a reward thread that times out keeps running)."""
MATH_TIMEOUT_S = 5
"""``math`` on the main thread: math-verify's own limit per parse and comparison (signal.alarm, which only
works on the main thread; ``rewards.score`` runs rewards in worker threads, under its own timeout)."""

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_NUMBER = re.compile(rf"([+-]?{_DECIMAL})(?:\s*/\s*({_DECIMAL}))?")
_SCIENTIFIC = re.compile(rf"[+-]?{_DECIMAL}", re.ASCII)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces close; None if there is none.
    One pass over the text, whatever the number of unclosed boxes (a completion cut off by max_tokens)."""
    opens = [m.end() - 1 for m in _BOX.finditer(text)]
    if not opens:
        return None
    closes: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (\{ \} \\) is not a brace
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            closes[stack.pop()] = i
        i += 1
    for start in reversed(opens):
        if start in closes:
            return text[start + 1 : closes[start]]
    return None


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0].strip() if text else ""


def final_answer(text: str) -> str:
    """What a completion or a reference answers, by the rules in this module's docstring; "" if nothing."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for mark in ("####", "="):
        if mark in text:
            return _first_line(text.rsplit(mark, 1)[1])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalise(answer: str) -> str:
    """Whitespace and a trailing period stripped, thousands separators dropped ("1,234" -> "1234"); case kept."""
    text = answer.strip()
    text = text.removesuffix(".").rstrip()
    return _THOUSANDS.sub("", text)


def parse_number(answer: str) -> Fraction | None:
    """The exact value of an integer, decimal, fraction ("3/4"), with a leading +/-, thousands separators, a
    trailing % (a unit: "50%" reads 50, as GSM8K answers write it) or an exponent ("1.5e-3", up to 3 digits);
    None if the answer is anything else."""
    text = normalise(answer).removesuffix("%").rstrip()
    match = _NUMBER.fullmatch(text) if len(text) <= 200 else None
    if match is None:
        return None
    value = Fraction(match[1])
    if match[2] is None:
        return value
    denominator = Fraction(match[2])
    return value / denominator if denominator else None


def _reference(reference: str) -> str:
    if not reference:
        raise ValueError("the reference has no final answer")
    return reference


def exact_equal(answer: str, reference: str) -> bool:
    """The two final answers are the same text once normalised (``normalise``)."""
    ref = normalise(_reference(reference))
    return bool(answer) and normalise(answer) == ref


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    """Exactly equal if both are integers, else within ``REL_TOL`` of the larger magnitude."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def numeric_equal(answer: str, reference: str) -> bool:
    """Both final answers are numbers (``parse_number``) and equal (``numbers_equal``)."""
    ref = parse_number(_reference(reference))
    if ref is None:
        raise ValueError(f"the reference's final answer {reference[:60]!r} is not a number")
    value = parse_number(answer)
    return value is not None and numbers_equal(value, ref)


def math_verify_installed() -> bool:
    """Whether math-verify can be imported, without importing it (it imports sympy)."""
    try:
        return importlib.util.find_spec("math_verify") is not None
    except (ImportError, ValueError):
        return False


def _math_parse(mv: Any, answer: str, timeout_s: int | None) -> list[Any]:
    """math-verify's reading of a final answer. Read as LaTeX math (``$...$``), which takes plain numbers and
    expressions too; a number with an exponent is handed over as an exact fraction (math-verify reads "1e-3"
    as 1 or as e - 3)."""
    if _SCIENTIFIC.fullmatch(answer) and "e" in answer.lower():
        value = Fraction(answer)
        text = str(value) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
        answer = f"${text}$"
    elif "$" not in answer:
        answer = f"${answer}$"
    return mv.parse(answer, parsing_timeout=timeout_s)


def math_equal(answer: str, reference: str) -> bool:
    """math-verify says the completion's final answer equals the reference's ("\\frac{1}{2}", "0.5" and "1/2"
    agree). Imports math_verify (the ``math`` extra) when called. Off the main thread math-verify's timeouts
    are off (they use signal.alarm); ``rewards.score`` bounds the call instead."""
    import math_verify

    timeout_s = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = _math_parse(math_verify, _reference(reference), timeout_s)
    if not gold:
        raise ValueError(f"math-verify found nothing in the reference's final answer {reference[:60]!r}")
    if not answer or len(answer) > MAX_MATH_CHARS:
        return False
    target = _math_parse(math_verify, answer, timeout_s)
    return bool(target) and bool(math_verify.verify(gold, target, timeout_seconds=timeout_s))
