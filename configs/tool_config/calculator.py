"""The calculator tool of the GSM8K tool-trace recipe (`multi_turn.function_tool_path`): the
arithmetic of a GSM8K annotation (`<<48/2=24>>`) evaluated exactly. The SFT traces of
`scripts/preprocess_gsm8k_tool_sft.py` call it with the same schema, so SFT and RL see one tool.
"""
import ast
import operator
from fractions import Fraction

from verl.tools.function_tool import function_tool

OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv,
}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
            raise ValueError("only small whole powers")
        return Fraction(OPS[type(node.op)](left, right))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def evaluate(expression):
    """The value of an arithmetic expression as GSM8K writes results: an integer when whole,
    else a decimal (at most 6 places, trailing zeros dropped)."""
    text = expression.replace(",", "").replace("x", "*").replace("×", "*").replace("÷", "/")
    value = _eval(ast.parse(text.strip(), mode="eval"))
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


@function_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression (+, -, *, /, parentheses) and returns its value.

    Args:
        expression: The arithmetic expression to evaluate, e.g. 48/2.
    """
    try:
        return evaluate(expression)
    except Exception as e:  # the model sees the error text and may try again
        return f"Error: {e}"
