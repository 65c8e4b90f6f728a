"""Verifiable answers: extract the final answer of a response (a `#### 42` line, a `\\boxed{42}`,
or the last number), normalise numbers (`1,000` = `1000` = `1000.0`, `-3/4`, `\\frac{3}{4}`), and
compare it with a reference answer. Pure Python, no model.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

# A number as people write it: a sign, digits with optional thousands commas, a decimal part, or a
# fraction a/b. Digits glued to letters or to more digits are not a separate number.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?"
# A LaTeX fraction is one number, not the two inside its braces (a bare `\frac{1}{2}` read as 2).
_LATEX_FRACTION = r"-?\\[dt]?frac\{-?[\d.,]+\}\{-?[\d.,]+\}"
_NUMBER_RE = re.compile(rf"{_LATEX_FRACTION}|(?<![\w.,]){_NUMBER}(?![\w])")
_HASHES_RE = re.compile(r"####\s*(.+)")
_GROUPED_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:/-?\d+)?")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}$")


def final_answer(text: str) -> Optional[str]:
    """The answer a response states last: what follows the last `####`, else the content of the
    last `\\boxed{...}`, else the last number in the text; None when there is none."""
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (braces may nest), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def to_number(answer: str) -> Optional[Fraction]:
    """An answer as an exact number: `1,000` -> 1000, `1000.0` -> 1000, `-3/4`, `\\frac{3}{4}`,
    `$42.`, `42%` -> 42; None when the answer is not one number."""
    text = answer.strip().strip("$").strip().rstrip(".").strip()
    text = text.removesuffix("\\%").removesuffix("%").strip()
    frac = _FRAC_RE.match(text)
    if frac:
        numerator, denominator = to_number(frac.group(2)), to_number(frac.group(3))
        if numerator is None or denominator is None or denominator == 0:
            return None
        return (-1 if frac.group(1) else 1) * numerator / denominator
    if "," in text and not _GROUPED_RE.fullmatch(text.replace(" ", "")):
        return None  # commas that are not thousands separators: not one number
    text = text.replace(",", "").replace(" ", "")
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def answers_match(response: str, reference: str) -> bool:
    """Whether the final answer of `response` equals `reference` (itself given as a bare answer, or
    as a worked solution ending in `#### N` / `\\boxed{N}`): numerically when both are numbers,
    else as text with case and surrounding space ignored."""
    got = final_answer(response)
    want = final_answer(reference) if ("####" in reference or "\\boxed" in reference) else reference.strip()
    if got is None or want is None:
        return False
    got_number, want_number = to_number(got), to_number(want)
    if got_number is not None and want_number is not None:
        return got_number == want_number
    return normalise_text(got) == normalise_text(want)


def states_answer_in_format(response: str) -> bool:
    """Whether the response marks its final answer explicitly (a `#### ` line or a `\\boxed{}`)."""
    return bool(_HASHES_RE.search(response)) or last_boxed(response) is not None


def normalise_text(text: str) -> str:
    """Case and runs of white space ignored, as exact-match comparisons usually mean."""
    return " ".join(text.split()).casefold()
