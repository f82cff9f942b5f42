#!/usr/bin/env python3
"""Extracts the command lines of verl's example scripts that launch `verl.trainer.main_ppo`.

Each script of a verl checkout (`examples/**/*.sh` naming `verl.trainer.main_ppo`) is run by
bash in a scratch copy of the checkout, with stand-ins on PATH for python3/uv/ray/... that record
the arguments of a `-m verl.trainer.main_ppo` launch instead of running anything. The scripts'
own variables, arrays and defaults are expanded by bash itself, exactly as a user running the
script would get them. Nothing of verl's code is copied: the output is the argument lists only.

Usage: scripts/verl_examples.py GIT_DIR COMMIT OUT_DIR
       scripts/verl_examples.py --re-expect OUT_DIR   (families and "expect" again, for the
       recorded lines, after SUPPORTED_FAMILIES or the rules below change)
(GIT_DIR: a bare clone of verl, e.g. `git clone --bare https://github.com/verl-project/verl`.)
The fixtures in tests/fixtures/verl_scripts/ were written with
  scripts/verl_examples.py <volcengine/verl> b178a3cd5 tests/fixtures/verl_scripts
  scripts/verl_examples.py <verl-project/verl> 1dda039b9 tests/fixtures/verl_scripts
Writes OUT_DIR/COMMIT.jsonl, one JSON object per launch: {"script", "commit", "launch" (index
within the script), "argv", "model" (the model id the script means), "models" (the family of
each model path the line names), "expect"}, and adds to
OUT_DIR/example_configs.json the config files of verl's examples/ folder that a launch names with
--config-path (as data: their keys and values, without comments).

"expect" is what main_ppo should do with the line, judged from the line alone (see `expect`):
"pass", or {"refused": [keys, one of which the error must name], "reason": "..."}.
"""
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDER = r'''#!/usr/bin/env bash
# Stand-in for python3/python: records a main_ppo launch, answers "no" to probes.
args=("$@")
for ((i=0; i<${#args[@]}; i++)); do
  if [ "${args[$i]}" = "-m" ] && [ "${args[$((i+1))]}" = "verl.trainer.main_ppo" ]; then
    python_real=/usr/bin/python3
    "$python_real" -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "${args[@]:$((i+2))}" >> "$VERL_EXAMPLES_OUT"
    exit 0
  fi
  if [ "${args[$i]}" = "-c" ]; then
    # the torch_npu probe fails: a GPU machine (DEVICE=gpu is also set)
    case "${args[$((i+1))]}" in
      *torch_npu*) exit 1 ;;
    esac
    exit 0
  fi
done
exit 0
'''

LAUNCHER = r'''#!/usr/bin/env bash
# Stand-in for launchers (uv run, srun, ray job submit): a python3 among the arguments runs the
# recorder with what follows it.
args=("$@")
for ((i=0; i<${#args[@]}; i++)); do
  case "${args[$i]}" in
    python|python3) exec "$(dirname "$0")/python3" "${args[@]:$((i+1))}" ;;
  esac
done
exit 0
'''

NOOP = "#!/usr/bin/env bash\nexit 0\n"
# A fixed clock, so that names built from `date` are the same on every extraction.
DATE = "#!/usr/bin/env bash\nexec /bin/date -u -d '2026-01-01 00:00:00' \"$@\"\n"
NVSMI = "#!/usr/bin/env bash\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)\"; done\n"


def shims(d: Path):
    d.mkdir(parents=True, exist_ok=True)
    files = {"python3": RECORDER, "python": RECORDER, "nvidia-smi": NVSMI, "date": DATE}
    for name in ["uv", "srun", "ray", "mpirun"]:
        files[name] = LAUNCHER
    for name in ["conda", "huggingface-cli", "hf", "modelscope", "wget", "curl", "pip", "pip3",
                 "torchrun", "sleep", "npu-smi", "git", "nvcc", "srun", "sbatch", "mlflow",
                 "docker", "apptainer", "singularity", "ibstat", "hostname_ip"]:
        files.setdefault(name, NOOP)
    for name, text in files.items():
        p = d / name
        p.write_text(text)
        p.chmod(0o755)


# ---- what main_ppo should make of a line ----

# Families the model code implements (config.json architectures); the vision-language ones are
# qwen2_5_vl, qwen3_vl and qwen3_vl_moe (glm4v, minicpmo, kimi_k25 are not).
SUPPORTED_FAMILIES = {"qwen2", "llama", "mistral", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next",
                      "seed_oss", "mimo", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen2_moe", "gemma2",
                      "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}

# A model id's family, by its name (the first pattern found wins; VL before the base family).
# "vllm" in a script's name is the rollout engine, not "-vl"/"_vl" (see `family`).
VISION_FAMILIES = {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}

FAMILY_PATTERNS = [
    # Qwen3-VL's MoE models (30B-A3B, 235B-A22B) before the dense ones.
    ("qwen3-vl-30b-a3b", "qwen3_vl_moe"), ("qwen3-vl-235b-a22b", "qwen3_vl_moe"),
    ("qwen3_vl_moe", "qwen3_vl_moe"),
    ("qwen3-vl", "qwen3_vl"), ("qwen3_vl", "qwen3_vl"),
    ("-vl", "qwen2_5_vl"), ("_vl", "qwen2_5_vl"),
    # Qwen3.5 / Qwen3-Next (hybrid attention) and the Qwen3 MoE models before dense Qwen3.
    ("qwen3.5", "qwen3_5"), ("qwen3_5", "qwen3_5"), ("qwen3-next", "qwen3_next"),
    ("qwen3-30b-a3b", "qwen3_moe"), ("qwen3-235b-a22b", "qwen3_moe"), ("qwen3-coder-30b", "qwen3_moe"),
    ("qwen30_a3b", "qwen3_moe"),
    ("qwen3", "qwen3"), ("qwen1.5-moe", "qwen2_moe"),
    ("qwen2", "qwen2"), ("qwen30", "qwen3"), ("deepseek-llm", "llama"), ("deepseek-math", "llama"),
    # DeepSeek-V4 is its own architecture (transformers' deepseek_v4), and Kimi-K2.5/K2.6 are
    # vision-language models (kimi_k25) around a DeepSeek-V3 text model; Kimi-K2 is
    # DeepseekV3ForCausalLM.
    ("deepseek-v4", "deepseek_v4"), ("kimi-k2.5", "kimi_k25"), ("kimi-k2.6", "kimi_k25"),
    ("deepseek-v", "deepseek_v3"), ("dsv3", "deepseek_v3"), ("deepseek671b", "deepseek_v3"),
    ("moonlight", "deepseek_v3"), ("kimi", "deepseek_v3"), ("llama", "llama"),
    ("mistral", "mistral"), ("gemma", "gemma2"), ("gpt-oss", "gpt_oss"), ("gptoss", "gpt_oss"),
    ("glm", "glm4v"), ("minicpm", "minicpmo"), ("seed-oss", "seed_oss"), ("mimo", "mimo"),
    ("nemotron", "nemotron_h"), ("hy3", "hunyuan_v1_moe"), ("skywork", "llama"),
    ("fsfairx", "llama"),
]

DEFAULT_MODEL = "~/models/deepseek-llm-7b-chat"  # verl's default actor and critic path


def family(model_id):
    m = model_id.lower().replace("vllm", "")
    for pat, fam in FAMILY_PATTERNS:
        if pat in m:
            return fam
    return "unknown"


def settings_of(argv, configs):
    """The line's settings: the example config file's keys (flattened), then the overrides."""
    out = {}
    name = next((a.split("=", 1)[1] for a in argv if a.startswith("--config-name=")), None)
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config-path=")), None)
    if path and name and path.startswith("examples/"):
        tree = configs.get(f"{path}/{name.removesuffix('.yaml')}.yaml", {})

        def flat(node, prefix):
            for k, v in node.items():
                if k in ("defaults", "hydra"):
                    continue
                if isinstance(v, dict) and v:
                    flat(v, prefix + [str(k)])
                else:
                    out[".".join(prefix + [str(k)])] = v
        flat(tree, [])
    for a in argv:
        if a.startswith("-") or "=" not in a:
            continue
        k, v = a.split("=", 1)
        out[k.lstrip("+~")] = v
    return out


def truthy(v):
    return str(v).strip().lower() in ("true", "1")


def unset(v):
    return v is None or str(v).strip().lower() in ("null", "none", "", "~")


# verl's advantage estimators and policy losses that main_ppo implements.
ESTIMATORS = {"gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "remax", "opo", "grpo_passk", "gpg", "gdpo",
              "optimal_token_baseline", "tir_optimal_token_baseline"}
LOSSES = {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "sapo", "cispo", "geo_mean", "dppo_tv", "dppo_kl", "dro"}
REWARD_MANAGERS = {"naive", "remote", "batch", "dapo", "gdpo", "prime"}

# verl's tool configs whose tools main_ppo's tool workers do not ship: the file name, and why
# (verl's geo3k tool config sets no `config.type`, and its class is verl's own module, which
# scores with mathruler).
UNSHIPPED_TOOLS = {
    "geo3k_tool_config.yaml": "verl's geo3k tool (verl.tools.geo3k_tool.Geo3kTool)",
}

# Keys a few example lines set that verl's own config does not define at that commit (verl
# refuses those lines too): (commit, key).
NOT_VERL_KEYS = {
    ("b178a3c", "actor_rollout_ref.model.torch_dtype"),
    ("1dda039", "actor_rollout_ref.actor.model_engine"),
    ("1dda039", "actor_rollout_ref.actor.policy_loss.tau_pos"),
    ("1dda039", "actor_rollout_ref.actor.policy_loss.tau_neg"),
}


def expect(entry, configs):
    """Which keys main_ppo must refuse in this line, from the line's own settings."""
    st = settings_of(entry["argv"], configs)
    refused = []

    def refuse(key, reason):
        refused.append((key, reason))

    fam = family(entry["model"])
    if fam not in SUPPORTED_FAMILIES:
        refuse("actor_rollout_ref.model.path", f"model family {fam}")
    if truthy(st.get("distillation.enabled")) and fam in VISION_FAMILIES:
        # The teachers would read the image placeholders without the images.
        refuse("distillation.enabled", "distillation of a vision-language student")
    if truthy(st.get("distillation.enabled")):
        # Each teacher's family, as the actor's (verl drops `teacher_model` beside named ones).
        teachers = {k: v for k, v in st.items()
                    if k.startswith("distillation.teacher_models.") and k.endswith(".model_path")}
        if len(teachers) > 1:
            teachers.pop("distillation.teacher_models.teacher_model.model_path", None)
        for key, path in teachers.items():
            if family(str(path)) not in SUPPORTED_FAMILIES:
                refuse(key, f"model family {family(str(path))}")
        if str(st.get("distillation.distillation_loss.policy_loss_mode", "vanilla")) != "vanilla":
            refuse("distillation.distillation_loss.policy_loss_mode", "distillation policy loss")
    adv = str(st.get("algorithm.adv_estimator", "gae"))
    critic_on = truthy(st.get("critic.enable")) or (adv == "gae" and not st.get("critic.enable"))
    critic_model = st.get("critic.model.path") or DEFAULT_MODEL
    if placeholder(str(critic_model)):
        critic_model = entry["model"]
    if critic_on and family(critic_model) not in SUPPORTED_FAMILIES and not unset(critic_model):
        refuse("critic.model.path", f"model family {family(critic_model)}")
    for role, on in (("actor_rollout_ref.actor", True), ("critic", critic_on)):
        # verl refuses a role that trains without a micro-batch size or token budgets too (the
        # critic's use_dynamic_bsz follows the actor's; b178a3c's PF-PPO line loses its
        # arguments to a comment after a backslash)
        if on and unset(st.get(f"{role}.ppo_micro_batch_size_per_gpu")) and \
                unset(st.get(f"{role}.ppo_micro_batch_size")) and not truthy(
                st.get(f"{role}.use_dynamic_bsz", st.get("actor_rollout_ref.actor.use_dynamic_bsz"))):
            refuse(f"{role}.ppo_micro_batch_size_per_gpu", "no micro-batch size (verl refuses it too)")
    if adv not in ESTIMATORS:
        refuse("algorithm.adv_estimator", f"advantage estimator {adv}")
    if adv in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        # Σπ² comes from the old-log-prob pass (verl asserts the key; bypass mode has no pass).
        if not truthy(st.get("actor_rollout_ref.actor.calculate_sum_pi_squared")):
            refuse("algorithm.adv_estimator", f"{adv} without calculate_sum_pi_squared")
            refuse("actor_rollout_ref.actor.calculate_sum_pi_squared", f"{adv} without calculate_sum_pi_squared")
        if truthy(st.get("algorithm.rollout_correction.bypass_mode")):
            refuse("algorithm.rollout_correction.bypass_mode", f"{adv} in bypass mode")
    if truthy(st.get("algorithm.use_pf_ppo")) and adv != "gae":
        # verl resamples after GAE only; here the pairing is refused rather than ignored
        refuse("algorithm.use_pf_ppo", f"PF-PPO with {adv}")
    loss = st.get("actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss is not None and str(loss) not in LOSSES:
        refuse("actor_rollout_ref.actor.policy_loss.loss_mode", f"policy loss {loss}")
    if truthy(st.get("actor_rollout_ref.rollout.multi_turn.enable")):
        fmt = st.get("actor_rollout_ref.rollout.multi_turn.format")
        if fmt is not None and str(fmt) not in ("hermes", "llama3_json"):
            refuse("actor_rollout_ref.rollout.multi_turn.format", f"tool-call format {fmt}")
        tools = str(st.get("actor_rollout_ref.rollout.multi_turn.tool_config_path", ""))
        for config, what in UNSHIPPED_TOOLS.items():
            if tools.endswith(config):
                refuse("actor_rollout_ref.rollout.multi_turn.tool_config_path", what)
    feature_flags = {
        # verl trains the MTP layers with an extra loss: not implemented (MiMo's are kept frozen)
        "actor_rollout_ref.model.mtp.enable": "multi-token prediction",
    }
    for key, what in feature_flags.items():
        if truthy(st.get(key)):
            refuse(key, what)
    for key, what in [
        ("data.custom_cls.path", "custom Python dataset class"),
        ("data.datagen.path", "custom Python data generator"),
        ("sandbox_fusion.url", "sandbox fusion"),
        ("reward.sandbox_fusion.url", "sandbox fusion"),
        ("reward_model.sandbox_fusion.url", "sandbox fusion"),
        ("actor_rollout_ref.rollout.quantization", "quantized rollouts"),
    ]:
        if not unset(st.get(key)):
            refuse(key, what)
            if key.endswith("sandbox_fusion.url"):
                # the legacy spellings are read as reward.sandbox_fusion.url, which the error names
                refuse("reward.sandbox_fusion.url", what)
    # A custom sampler class runs in a Python worker. The lines' `pkg://tests.utils.dataset...`
    # module is verl's own test file, importable from verl's repository root; the test
    # (tests/verl/mod.rs) puts a stand-in module under that same import path on PYTHONPATH and
    # leaves the line unchanged, so what is checked is the line as written (the import, the
    # class, its length over the data) rather than a path swapped for another file.
    sampler_path, sampler_name = st.get("data.sampler.class_path"), st.get("data.sampler.class_name")
    if not unset(sampler_path):
        if unset(sampler_name):
            refuse("data.sampler.class_name", "a sampler module without its class")
        if str(st.get("data.dataloader_num_workers", 8)) != "0":
            refuse("data.dataloader_num_workers", "loader workers with a custom sampler (verl asserts 0)")
    elif not unset(sampler_name):
        refuse("data.sampler.class_name", "a sampler class without its module")
    if truthy(st.get("algorithm.filter_groups.enable")):
        if truthy(st.get("algorithm.use_kl_in_reward")):
            refuse("algorithm.filter_groups.enable", "DAPO group filtering with the KL in the reward")
        if unset(st.get("algorithm.filter_groups.metric")):
            refuse("algorithm.filter_groups.metric", "DAPO group filtering without a metric")
    elif not unset(st.get("data.gen_batch_size")) and \
            str(st.get("data.gen_batch_size")) != str(st.get("data.train_batch_size", 1024)):
        refuse("data.gen_batch_size", "generation batches other than the step without group filtering")
    # actor_rollout_ref.rollout.over_sample_rate: declared by verl, read by nothing there;
    # accepted without effect.
    # An empty value where verl wants a flag or a number (paths the tests swap are left out).
    for a in entry["argv"]:
        k, eq, v = a.partition("=")
        if eq and v == "" and not a.startswith("-") and not re.search(r"(path|dir|files?)$", k):
            refuse(k.lstrip("+~"), "the script leaves a shell variable empty")
    for key, v in st.items():
        if key.endswith("router_replay.mode") and str(v) != "disabled":
            refuse(key, "MoE routing replay")
        if key.endswith("fsdp_config.model_dtype") and str(v).lower() not in ("fp32", "float32", "bf16", "bfloat16"):
            refuse(key, "fp16 weights")
        if key.endswith(("override_transformer_config.normalization",
                         "override_transformer_config.swiglu")):
            refuse(key, "Megatron model definition")
        if key == "trainer.device" and str(v).startswith("npu"):
            refuse(key, "Ascend NPU")
        if key.endswith("model.lora.rank") and str(v) not in ("0", "null"):
            refuse(key, "Megatron LoRA section")
        if key == "trainer.v1.trainer_mode" and str(v) != "sync":
            refuse(key, "asynchronous trainer")
        if (entry["commit"], key) in NOT_VERL_KEYS:
            refuse(key, "not a key of verl's config at this commit")
    for key in ["reward_model.reward_manager", "reward.reward_manager.name"]:
        v = st.get(key)
        if v is not None and str(v) not in REWARD_MANAGERS:
            refuse(key, f"reward manager {v}")
            refuse("reward.reward_manager.name", f"reward manager {v}")
    for a in entry["argv"]:
        k = a.split("=", 1)[0]
        if "@" in k and a.split("=", 1)[1].startswith("mlite"):
            refuse(k, "config-group option from an external Python package")
    if not refused:
        return "pass"
    keys = []
    for k, _ in refused:
        if k not in keys:
            keys.append(k)
    return {"refused": keys, "reason": "; ".join(dict.fromkeys(r for _, r in refused))}


MODEL_KEY = re.compile(r"(^|\.)(model\.path|model_path|tokenizer_path)$|^data\.tokenizer$")


def model_families(argv, model):
    """The family of each model path the line names (the actor's as the script means it; the
    actor's and critic's defaults where the line leaves them to verl)."""
    out = {"actor_rollout_ref.model.path": family(model), "critic.model.path": family(DEFAULT_MODEL)}
    for a in argv:
        k, _, v = a.partition("=")
        k = k.lstrip("+~")
        if MODEL_KEY.search(k) and k != "actor_rollout_ref.model.path":
            # A placeholder (a shell variable the extraction left empty) means the line's model.
            out[k] = family(model if placeholder(v) else v)
    return out


def placeholder(v):
    """A model path the script leaves to its user: empty, `model_path`, or `<...>`."""
    return v in ("", "model_path") or "<" in v


def model_of(entry_argv, script):
    """The model the line means: its actor path, else the script's name, else verl's default."""
    mp = next((a.split("=", 1)[1] for a in entry_argv
               if a.split("=", 1)[0].lstrip("+") == "actor_rollout_ref.model.path"), None)
    if mp is None:
        return DEFAULT_MODEL
    if placeholder(mp):
        return Path(script).stem  # a placeholder: the script's name says which model
    return mp


def example_configs(repo: Path, entries):
    """The examples/ config files the lines name with --config-path, and their defaults."""
    import yaml  # PyYAML, needed only for these
    out = {}
    for e in entries:
        path = next((a.split("=", 1)[1] for a in e["argv"] if a.startswith("--config-path=")), None)
        if not path or not path.startswith("examples/"):
            continue
        for f in sorted((repo / path).glob("*.yaml")):
            out[str(f.relative_to(repo))] = yaml.safe_load(f.read_text()) or {}
    return out


def re_expect(out_dir):
    configs = json.loads((out_dir / "example_configs.json").read_text())
    for path in sorted(out_dir.glob("*.jsonl")):
        if path.name.startswith("sft_"):
            continue  # verl's SFT lines (tests/sft): no expectations of this kind
        entries = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        for e in entries:
            e["models"] = model_families(e["argv"], e["model"])
            e["expect"] = expect(e, configs[e["commit"]])
        path.write_text("".join(json.dumps(e) + "\n" for e in entries))
        passing = sum(1 for e in entries if e["expect"] == "pass")
        print(f"{path.name}: {len(entries)} launches, {passing} expected to pass", file=sys.stderr)


def main():
    if sys.argv[1] == "--re-expect":
        return re_expect(Path(sys.argv[2]))
    git_dir, commit, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repo = tmp / "repo"
        repo.mkdir()
        archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
        shims(tmp / "bin")
        launch = re.compile(r"verl\.trainer\.main_ppo(?![\w.])")
        scripts = sorted(p for p in (repo / "examples").rglob("*.sh")
                         if launch.search(p.read_text(errors="replace")))
        prelude = tmp / "prelude.sh"
        # `ulimit -n` needs privileges a scratch run may lack; it changes no argument.
        prelude.write_text("ulimit() { :; }\n")
        for script in scripts:
            rel = str(script.relative_to(repo))
            rec = tmp / "out.jsonl"
            rec.write_text("")
            home = tmp / "home"
            home.mkdir(exist_ok=True)
            env = {"PATH": f"{tmp / 'bin'}:/usr/bin:/bin", "HOME": str(home),
                   "VERL_EXAMPLES_OUT": str(rec), "LANG": "C.UTF-8", "DEVICE": "gpu",
                   "USER": "user", "TERM": "dumb", "BASH_ENV": str(prelude)}
            # Variables a few scripts require instead of defaulting (placeholders only).
            for var in ["HDFS_ROOT", "RAY_DATA_HOME", "DATA_ROOT", "LORA_ADAPTER_PATH"]:
                env[var] = f"{home}/{var.lower()}"
            env["INFER_BACKEND"] = "vllm"
            env["KIMI_K2_6_MODEL_PATH"] = "moonshotai/Kimi-K2.6"
            # The cluster's own variables a few scripts read (one node of 8 GPUs).
            for var, v in [("SLURM_JOB_NUM_NODES", "1"), ("SLURM_NNODES", "1"),
                           ("SLURM_GPUS_PER_NODE", "8"), ("SLURM_CPUS_PER_TASK", "8"),
                           ("ARNOLD_WORKER_NUM", "1"), ("ARNOLD_WORKER_GPU", "8")]:
                env[var] = v
            try:
                r = subprocess.run(["bash", str(script)], cwd=repo, env=env, timeout=60,
                                   capture_output=True, text=True)
                rc, err = r.returncode, r.stderr[-400:]
            except subprocess.TimeoutExpired:
                rc, err = "timeout", ""
            launches = [json.loads(l) for l in rec.read_text().splitlines() if l.strip()]
            if not launches:
                print(f"{rel}: no launch recorded (exit {rc}): {err.strip().splitlines()[-1:]}",
                      file=sys.stderr)
            for i, argv in enumerate(launches):
                # The scratch paths back to the user's view of them.
                argv = [a.replace(str(home), "$HOME").replace(str(repo) + "/", "")
                        .replace(str(repo), ".") for a in argv]
                entries.append({"script": rel, "commit": commit[:7], "launch": i, "argv": argv,
                                "model": model_of(argv, rel)})
        configs_path = out_dir / "example_configs.json"
        configs = json.loads(configs_path.read_text()) if configs_path.exists() else {}
        configs[commit[:7]] = example_configs(repo, entries)
        configs_path.write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    for e in entries:
        e["models"] = model_families(e["argv"], e["model"])
        e["expect"] = expect(e, configs[commit[:7]])
    (out_dir / f"{commit[:7]}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    passing = sum(1 for e in entries if e["expect"] == "pass")
    print(f"{len(entries)} launches from {len(scripts)} scripts ({passing} expected to pass) "
          f"-> {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
