"""geo3k's reward for `scripts/geo3k_synthetic.py`'s data, with no library beyond Python's own:
verl's `verl/utils/reward_score/geo3k.py` formula,

    score = 0.9 * accuracy + 0.1 * format

- format is 1 when the whole response matches `<think>.*</think>.*\\boxed{.*}.*` (dot matching
  newlines), else 0;
- accuracy is 1 when the content of the response's last `\\boxed{...}` (braces balanced,
  stripped) equals the ground truth, else 0.

verl grades the boxed answer with mathruler's `grade_answer` (sympy equivalence of LaTeX
expressions); here answers are compared as text after dropping spaces and `$`, and as numbers
when both read as numbers ("12" equals "12.0"), which decides the synthetic set's integer
answers exactly. For Geometry3K's own answers (fractions, roots, LaTeX) use verl's scorer.

    reward.custom_reward_function.path=scripts/geo3k_reward.py
"""
import re

FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def last_boxed(text):
    """The content of the last `\\boxed{...}` of `text`, stripped; None without one or when its
    braces never close."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    body = text[start + len("\\boxed{"):]
    for i, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return body[:i].strip()
            depth -= 1
    return None


def same_answer(given, truth):
    """Equal as text (spaces and `$` dropped), or as numbers when both read as numbers."""
    def clean(s):
        return re.sub(r"[\s$]", "", str(s))

    given, truth = clean(given), clean(truth)
    if given == truth:
        return True
    try:
        return float(given) == float(truth)
    except ValueError:
        return False


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.1):
    answer = last_boxed(solution_str)
    accuracy = 1.0 if answer is not None and same_answer(answer, ground_truth) else 0.0
    well_formed = 1.0 if FORMAT.fullmatch(solution_str) else 0.0
    return (1.0 - format_score) * accuracy + format_score * well_formed
