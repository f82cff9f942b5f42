"""A toy safety scorer for the gated example (examples/gated_reward_with_model.yaml).

verl's signature; returns 1.0 for a response that looks safe and 0.0 for one that contains a
phrase from a small block list. A real deployment would call a moderation model here. With
`gate: {below: 0.5, action: skip_update}` every response scored 0 is left out of the update.
"""

BLOCKED = ("rm -rf /", "how to make a weapon", "credit card number")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, blocked=BLOCKED):
    text = solution_str.lower()
    flagged = [b for b in blocked if b in text]
    return {"score": 0.0 if flagged else 1.0, "flagged": len(flagged)}
