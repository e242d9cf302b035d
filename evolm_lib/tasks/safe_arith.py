"""A safe evaluator of arithmetic written by a model: numbers, + - * /, unary signs, parentheses.

The text is parsed with `ast.parse` and the tree is walked by hand; nothing is ever
compiled or run. Limits on length, nesting and literal size keep hostile text from
hanging the reward (a model may well write `9**9**9`).
"""
from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_LENGTH = 200
"""Longest expression text accepted, in characters."""
MAX_PARENTHESIS_DEPTH = 20
"""Deepest parenthesis nesting accepted."""
MAX_LITERAL = 10**6
"""Largest absolute value of a number literal."""
MAX_LITERAL_DIGITS = 15
"""Most characters in one number literal (stops `1.000...0001` style padding)."""

_BINARY_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class UnsafeExpressionError(ValueError):
    """The text is not a small arithmetic expression over + - * / and numbers."""


def evaluate_expression(text: str) -> float:
    """Value of an arithmetic expression; UnsafeExpressionError if not allowed, ZeroDivisionError on x / 0."""
    tree = _parse(text)
    try:
        value = _value_of(tree.body)
    except OverflowError as error:
        raise UnsafeExpressionError(f"value too large: {error}") from None
    if not math.isfinite(value):
        raise UnsafeExpressionError("value is not finite")
    return float(value)


def numbers_used(text: str) -> list[int]:
    """Integer literals of a safe expression, in order of appearance (signs are operators, not part of the number)."""
    tree = _parse(text)
    # ast.walk is breadth-first; sort by position to get reading order
    constants = [node for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    constants.sort(key=lambda node: (node.lineno, node.col_offset))
    return [node.value for node in constants if isinstance(node.value, int)]


def is_safe_expression(text: str) -> bool:
    """Whether `evaluate_expression` would accept the text's shape (division by zero aside)."""
    try:
        _parse(text)
    except UnsafeExpressionError:
        return False
    return True


def _parse(text: str) -> ast.Expression:
    """Parse and validate the expression, raising UnsafeExpressionError for anything not allowed."""
    if not isinstance(text, str):
        raise UnsafeExpressionError(f"expected text, got {type(text).__name__}")
    text = text.strip()
    # length first: every later step is then bounded by a small input
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise UnsafeExpressionError(f"expression longer than {MAX_EXPRESSION_LENGTH} characters")
    if not text:
        raise UnsafeExpressionError("empty expression")
    depth = 0
    for character in text:
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth > MAX_PARENTHESIS_DEPTH:
            raise UnsafeExpressionError(f"parentheses nested deeper than {MAX_PARENTHESIS_DEPTH}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        # ValueError: null bytes in the source on some Python versions
        raise UnsafeExpressionError(f"not an expression: {type(error).__name__}: {error}") from None
    _check(tree.body)
    return tree


def _check(node: ast.AST) -> None:
    """Reject every node that is not a number, an allowed operator, or a sign."""
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY_OPERATORS:
            raise UnsafeExpressionError(f"operator {type(node.op).__name__} not allowed")
        _check(node.left)
        _check(node.right)
    elif isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY_OPERATORS:
            raise UnsafeExpressionError(f"operator {type(node.op).__name__} not allowed")
        _check(node.operand)
    elif isinstance(node, ast.Constant):
        value = node.value
        # bool is an int subclass: `True + True` must not count as arithmetic
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsafeExpressionError(f"literal {value!r} is not a number")
        if not math.isfinite(value) or abs(value) > MAX_LITERAL:
            raise UnsafeExpressionError(f"literal larger than {MAX_LITERAL}")
        segment_length = (node.end_col_offset or 0) - node.col_offset
        if segment_length > MAX_LITERAL_DIGITS:
            raise UnsafeExpressionError(f"literal longer than {MAX_LITERAL_DIGITS} characters")
    else:
        raise UnsafeExpressionError(f"{type(node).__name__} not allowed in an expression")


def _value_of(node: ast.AST) -> int | float:
    """Value of a checked node; ints stay exact until a division."""
    if isinstance(node, ast.BinOp):
        value = _BINARY_OPERATORS[type(node.op)](_value_of(node.left), _value_of(node.right))
        # float products overflow to inf silently, and 1 / inf would then hide it as 0.0
        if isinstance(value, float) and not math.isfinite(value):
            raise UnsafeExpressionError("intermediate value is not finite")
        return value
    if isinstance(node, ast.UnaryOp):
        return _UNARY_OPERATORS[type(node.op)](_value_of(node.operand))
    return node.value  # a checked ast.Constant
