"""One canonical string per answer, so that equal answers written differently compare equal.

Numbers become exact rationals: "22", "22.0", "+22" and "22." agree; "1,000" and "1{,}000" are
1000; "0.5", ".5", "1/2", "\\frac{1}{2}", "\\dfrac12" and "$\\frac{1}{2}$" are all "1/2". Anything
that is not a number keeps its text with LaTeX noise and spaces removed: "\\left( 1, 2 \\right)" is
"(1,2)".
"""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rl.rewards.extract import strip_boxed

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_DECIMAL = re.compile(rf"^{_NUM}$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SLASH = re.compile(rf"^({_NUM})/({_NUM})$")
_FRAC = re.compile(rf"^([+-]?)\\frac(?:\{{({_NUM})\}}|(\d))(?:\{{({_NUM})\}}|(\d))$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox)\{([^{}]*)\}")
# Sizing and spacing commands that change nothing about the value (not followed by a letter, so
# that e.g. \leftarrow survives).
_NOISE = re.compile(r"\\(?:left|right|displaystyle|big|Big|bigl|bigr|Bigl|Bigr)(?![a-zA-Z])|\\[!,;:]")


def normalize_answer(text: str) -> str:
    """The canonical form of an answer (see the module docstring)."""
    s = strip_boxed(text.strip())
    s = strip_boxed(s.replace("$", ""))
    s = s.replace("\u2212", "-").replace("\\ ", "")
    s = _NOISE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = s.replace("{,}", ",")
    s = "".join(s.split())
    if "=" in s:  # "x = 5" answers 5 (the Minerva / DAPO convention)
        s = s.rsplit("=", 1)[1]
    s = s.rstrip(".")
    value = parse_number(s)
    if value is None:
        return s
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def parse_number(s: str) -> Fraction | None:
    """The exact value of an integer, decimal, thousands-separated, a/b or \\frac{a}{b} string, else None."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _DECIMAL.match(s):
        return Fraction(s)
    parts: tuple[str, str, str] | None = None
    if match := _SLASH.match(s):
        parts = ("", match.group(1), match.group(2))
    elif match := _FRAC.match(s):
        parts = (match.group(1), match.group(2) or match.group(3), match.group(4) or match.group(5))
    if parts is None:
        return None
    sign, numerator, denominator = parts
    if Fraction(denominator) == 0:
        return None
    value = Fraction(numerator) / Fraction(denominator)
    return -value if sign == "-" else value
