"""A composite GSM8K reward with verl's signature, usable unchanged by verl and by main_ppo.

    custom_reward_function.path=examples/custom_rewards.py custom_reward_function.name=compute_score

or as one weighted source next to the built-in scorer (examples/gsm8k_composite_reward.yaml).

The score adds three parts, each in [0, 1] before weighting:
- correctness (weight 1.0): the number after the last "####" equals the ground truth
  (commas and a leading "$" ignored, so "#### $1,234" counts);
- reasoning steps (weight 0.2): the share of the expected number of non-empty lines before the
  final answer, capped at 1 (GSM8K solutions have 2-8 steps; `min_steps` sets the target);
- calculator annotations (weight 0.1): GSM8K's "<<48/2=24>>" notes that are arithmetically right,
  as a share of all annotations (0 when there are none).
The returned dict also reports each part, which main_ppo logs next to the score.
"""
import re

ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
CALC = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
SAFE_EXPR = re.compile(r"^[0-9.+\-*/() ]+$")


def _number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _final_answer(solution_str):
    found = ANSWER.findall(solution_str)
    return _number(found[-1]) if found else None


def _steps(solution_str):
    body = solution_str.split("####")[0]
    return sum(1 for line in body.splitlines() if line.strip())


def _calculator_accuracy(solution_str):
    notes = CALC.findall(solution_str)
    if not notes:
        return 0.0
    right = 0
    for expr, result in notes:
        if not SAFE_EXPR.match(expr):
            continue
        try:
            value = eval(expr, {"__builtins__": {}}, {})  # digits and operators only
        except (SyntaxError, ZeroDivisionError):
            continue
        expected = _number(result)
        if expected is not None and abs(value - expected) < 1e-6:
            right += 1
    return right / len(notes)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, min_steps=3, weights=(1.0, 0.2, 0.1)):
    answer = _final_answer(solution_str)
    truth = _number(str(ground_truth))
    correct = float(answer is not None and truth is not None and abs(answer - truth) < 1e-6)
    steps = min(_steps(solution_str) / max(min_steps, 1), 1.0)
    calc = _calculator_accuracy(solution_str)
    w_correct, w_steps, w_calc = weights
    return {
        "score": w_correct * correct + w_steps * steps + w_calc * calc,
        "correct": correct,
        "steps": steps,
        "calculator": calc,
    }
