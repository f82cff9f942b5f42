#!/usr/bin/env python3
"""Writes configs/ppo_trainer.yaml: every key of `main_ppo config show` (the built-in defaults)
with the doc comment of its Rust field above it. Run from the repository root after changing a
config section: `python3 scripts/gen_ppo_trainer_yaml.py`. The test
`config::tests::ppo_trainer_yaml_equals_defaults` keeps the file equal to the defaults."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# YAML path -> Rust struct holding its fields.
STRUCTS = {
    "": "Config",
    "data": "DataConfig",
    "data.sampler": "SamplerConfig",
    "actor_rollout_ref": "ActorRolloutRefConfig",
    "actor_rollout_ref.model": "ModelConfig",
    "actor_rollout_ref.model.fsdp_config": "FsdpConfig",
    "actor_rollout_ref.model.fsdp_config.mixed_precision": "MixedPrecision",
    "actor_rollout_ref.actor": "ActorConfig",
    "actor_rollout_ref.actor.optim": "OptimConfig",
    "actor_rollout_ref.actor.optim.override_optimizer_config": "OptimizerOverrides",
    "actor_rollout_ref.actor.policy_loss": "PolicyLossConfig",
    "actor_rollout_ref.actor.checkpoint": "CheckpointContents",
    "actor_rollout_ref.actor.fsdp_config": "FsdpConfig",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision": "MixedPrecision",
    "actor_rollout_ref.rollout": "RolloutConfig",
    "actor_rollout_ref.rollout.val_kwargs": "SamplingConfig",
    "actor_rollout_ref.rollout.multi_turn": "MultiTurnConfig",
    "actor_rollout_ref.rollout.agent": "AgentConfig",
    "actor_rollout_ref.rollout.agent.custom_async_server": "CustomAsyncServerConfig",
    "actor_rollout_ref.ref": "RefConfig",
    "actor_rollout_ref.ref.fsdp_config": "FsdpConfig",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision": "MixedPrecision",
    "critic": "CriticConfig",
    "critic.optim": "OptimConfig",
    "critic.optim.override_optimizer_config": "OptimizerOverrides",
    "critic.model": "ModelConfig",
    "critic.model.fsdp_config": "FsdpConfig",
    "critic.model.fsdp_config.mixed_precision": "MixedPrecision",
    "critic.checkpoint": "CheckpointContents",
    "reward": "RewardConfig",
    "reward.custom_reward_function": "CustomRewardFunction",
    "reward.reward_manager": "RewardManagerConfig",
    "reward.reward_model": "RewardModelConfig",
    "reward.control": "RewardControlConfig",
    "algorithm": "AlgorithmConfig",
    "algorithm.kl_ctrl": "KlCtrlConfig",
    "algorithm.filter_groups": "FilterGroupsConfig",
    "algorithm.rollout_correction": "RolloutCorrectionConfig",
    "algorithm.pf_ppo": "PfPpoConfig",
    "distillation": "DistillationConfig",
    "distillation.distillation_loss": "DistillationLossConfig",
    "distillation.teacher_models.teacher_model": "TeacherModelConfig",
    "distillation.teacher_models.teacher_model.inference": "TeacherInferenceConfig",
    "trainer": "TrainerConfig",
}
SECTION_DOCS = {
    "data": "Data files, prompt construction, batching, filtering and shuffling.",
    "actor_rollout_ref": "The policy: one model that generates (rollout), trains (actor) and, frozen, is the reference.",
    "critic": "The value model (used by adv_estimator=gae).",
    "reward": "Where scores come from.",
    "algorithm": "Advantage estimation and KL control.",
    "distillation": "On-policy distillation: frozen teachers' log-probs of each response in the actor's loss.",
    "trainer": "Run length, logging, validation, checkpoints, device.",
}

# Entries of maps whose keys the user names (their fields are documented by their struct).
ENTRY_DOCS = {
    "distillation.teacher_models.teacher_model": "verl's default (single) teacher entry; add others with +distillation.teacher_models.<name>.*",
}


def field_docs():
    docs = {}
    for f in sorted((ROOT / "src/config").glob("*.rs")):
        text = f.read_text()
        for m in re.finditer(r"pub struct (\w+) \{(.*?)\n\}", text, re.S):
            name, body = m.group(1), m.group(2)
            fields = {}
            pending, rename = [], None
            for line in body.splitlines():
                s = line.strip()
                if s.startswith("///"):
                    pending.append(s[3:].strip())
                elif s.startswith("#[serde(rename"):
                    rename = re.search(r'rename = "([^"]+)"', s).group(1)
                elif s.startswith("pub "):
                    field = re.match(r"pub (\w+):", s).group(1)
                    fields[rename or field] = " ".join(pending)
                    pending, rename = [], None
                elif s.startswith("#["):
                    continue
                else:
                    pending = []
            docs[name] = fields
    return docs


def main():
    out = subprocess.run(["cargo", "run", "-q", "--", "config", "show"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    docs = field_docs()
    lines = [
        "# main_ppo's defaults: every key, its default value and what it does.",
        "# Keys and defaults are verl's (verl/trainer/config/ppo_trainer.yaml) unless the comment says otherwise;",
        "# verl keys that have no effect here (FSDP, vLLM, Ray settings) are accepted on the command line and reported.",
        "# Written by scripts/gen_ppo_trainer_yaml.py; a test keeps it equal to the built-in defaults.",
        "",
    ]
    stack = []  # (indent, key)
    for line in out.splitlines():
        m = re.match(r"^( *)(- )?([^:]+):(.*)$", line)
        if not m or m.group(2):
            lines.append(line)
            continue
        indent = len(m.group(1))
        key = m.group(3).strip().strip("'")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = ".".join(k for _, k in stack)
        struct = STRUCTS.get(parent)
        doc = docs.get(struct, {}).get(key, "") if struct else ""
        if f"{parent}.{key}" in ENTRY_DOCS:
            doc = ENTRY_DOCS[f"{parent}.{key}"]
        if parent == "" and key in SECTION_DOCS:
            doc = SECTION_DOCS[key]
            lines.append("")
        if doc:
            lines.append(" " * indent + "# " + doc)
        elif struct:
            print(f"no doc for {parent}.{key}", file=sys.stderr)
        lines.append(line)
        stack.append((indent, key))
    (ROOT / "configs/ppo_trainer.yaml").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
