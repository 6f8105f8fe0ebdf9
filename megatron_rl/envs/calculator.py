"""The `calculator` tool: exact arithmetic by a small recursive-descent parser (no `eval`).

Grammar: expr = term (("+" | "-") term)*; term = unary (("*" | "/" | "//" | "%") unary)*;
unary = ("+" | "-") unary | power; power = atom ("**" unary)?; atom = number | "(" expr ")".
Numbers are integers or decimals, computed as exact fractions. Bounded: at most
`MAX_EXPRESSION_CHARS` characters, `MAX_NESTING` levels of parentheses, signs and powers, exponents
of at most `MAX_EXPONENT` in magnitude, and numbers (literals and results) of at most `MAX_DIGITS`
digits, so no input can make it run long, recurse deep or use much memory.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from megatron_rl.envs.tools import ToolEnvironment

MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 64
MAX_DIGITS = 64
MAX_NESTING = 32
_TOKEN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+|\*\*|//|[-+*/%()])")


class CalculatorError(ValueError):
    pass


def _tokens(expression: str) -> list[str]:
    out, pos = [], 0
    stripped = expression.rstrip()
    while pos < len(stripped):
        match = _TOKEN.match(stripped, pos)
        if not match:
            raise CalculatorError(f"unexpected character {stripped[pos:].lstrip()[:1]!r} at position {pos}")
        out.append(match.group(1))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def nested(self) -> None:
        """One level deeper (a parenthesis, a sign or a power): the recursion stays bounded."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise CalculatorError(f"nested deeper than {MAX_NESTING} levels")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalculatorError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _bounded(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op, rhs = self.take(), self.unary()
            if op != "*" and rhs == 0:
                raise CalculatorError("division by zero")
            if op == "*":
                value = value * rhs
            elif op == "/":
                value = value / rhs
            elif op == "//":
                value = Fraction(value // rhs)
            else:
                value = value - rhs * (value // rhs)
            value = _bounded(value)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            sign = self.take()
            self.nested()
            value = self.unary()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() != "**":
            return base
        self.take()
        self.nested()
        exponent = self.unary()
        self.depth -= 1
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponents must be integers of at most {MAX_EXPONENT} in magnitude")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        largest = max(abs(base.numerator), base.denominator)
        if abs(int(exponent)) * math.log10(largest) > MAX_DIGITS:  # checked before computing it
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return _bounded(base ** int(exponent))

    def atom(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            self.nested()
            value = self.expr()
            if self.peek() != ")":
                raise CalculatorError("missing ')'")
            self.take()
            self.depth -= 1
            return value
        if tok[0].isdigit() or tok[0] == ".":
            return _bounded(Fraction(tok))
        raise CalculatorError(f"unexpected {tok!r}")


def _bounded(value: Fraction) -> Fraction:
    if len(str(abs(value.numerator))) > MAX_DIGITS or len(str(value.denominator)) > MAX_DIGITS:
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    return value


def evaluate_expression(expression: str) -> str:
    """The value of an arithmetic expression: an integer, or a decimal rounded to 12 places."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(_tokens(expression))
    if parser.peek() is None:
        raise CalculatorError("empty expression")
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after a complete expression")
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


class CalculatorEnv(ToolEnvironment):
    """One tool, `calculator(expression: str)`; the episode ends at the first turn without a call."""

    tool_names = ("calculator",)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise CalculatorError('calculator needs {"expression": "<arithmetic>"}')
        return evaluate_expression(expression)
