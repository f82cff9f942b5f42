"""A shaping reward for tool-agent runs: 1.0 when the response contains a tool-call opening tag,
else 0.0. Weighted 0.1 next to the GSM8K scorer (configs/gsm8k_tool_agent_smollm2.yaml) it is
verl's `gsm8k_toolcall_shaping` recipe (examples/sglang_multiturn at b178a3c: the GSM8K score plus
0.1 when `<tool_call>` appears in the response), which rewards trying the tool while a small model
rarely solves the problem and so rarely sees the outcome reward.

The response text holds the whole conversation after the prompt (model turns and tool turns), so
a malformed call earns the bonus too, as in verl's recipe."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, trigger="<tool_call>"):
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a string, got {type(solution_str).__name__}")
    return 1.0 if trigger and trigger in solution_str else 0.0
