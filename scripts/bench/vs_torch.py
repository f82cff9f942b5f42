"""The PyTorch / TRL side of scripts/bench_vs_torch.sh, and the driver that runs both sides.

Each measurement runs in its own process (so its peak RSS is its own), under /usr/bin/time -v,
with the same thread count on both sides. Subcommands:

  prepare-hf  --gguf FILE --out DIR          an HF copy (safetensors + config + tokenizer) of the GGUF,
                                             dequantised to f32 by transformers (`gguf_file=`)
  check       --hf DIR --ours FILE --prompt FILE [--new N]
  fwdbwd      --hf DIR [--batch 8 --seq 256 --warmup 1 --reps 2]
  gen         --hf DIR --prompt FILE [--batch 32 --new 128 --warmup-new 4]
  adamw       --hf DIR [--warmup 1 --reps 3]
  grpo        --hf DIR --data FILE.parquet --out DIR [--steps 3 --max-new 128]
  run         the driver (see scripts/bench_vs_torch.sh --help)

Workers print one line `RESULT {json}`. Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

GIB = float(1 << 30)


def peak_rss_bytes() -> int | None:
    """VmHWM of this process, the same counter main_ppo reports as perf/max_memory_rss_gb."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def emit(d: dict) -> None:
    d.setdefault("peak_rss_bytes", peak_rss_bytes())
    print("RESULT " + json.dumps(d), flush=True)


def torch_setup(threads: int):
    import torch

    torch.set_num_threads(threads)
    return torch


def load_model(hf: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf)
    return model, tok, time.perf_counter() - t0


def no_eos(model) -> None:
    """Generation that ignores EOS: generate() fills unset values from the model's own
    generation config, so EOS is removed there."""
    model.generation_config.eos_token_id = None


def base(threads: int, load_s: float) -> dict:
    import torch

    return {"side": "pytorch", "threads": torch.get_num_threads(), "load_s": load_s}


# ---------------------------------------------------------------------------------------------
# workers


def up_to_date(out: Path, stamp: str) -> bool:
    """Whether `out` was written (by `publish`) from the source `stamp` describes."""
    src = out / ".source"
    return (out / "model.safetensors").is_file() and src.is_file() and src.read_text() == stamp


def publish(tmp: Path, out: Path, stamp: str) -> None:
    """`tmp`, completely written, becomes `out` (replacing it), stamped with its source."""
    import shutil

    (tmp / ".source").write_text(stamp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def cmd_prepare_hf(a) -> None:
    """Dequantise the GGUF with transformers and write an HF directory. transformers refuses
    save_pretrained on a model it loaded from GGUF, so weights and config are written here."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(a.gguf)
    out = Path(a.out)
    stamp = f"{gguf.resolve()} {gguf.stat().st_size} {int(gguf.stat().st_mtime)}"
    if up_to_date(out, stamp):
        print(f"HF copy up to date: {out}", file=sys.stderr)
        return
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    sd = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    weights = {
        k: v.detach().contiguous()
        for k, v in sd.items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(str(tmp))
    model.generation_config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    publish(tmp, out, stamp)
    n = sum(v.numel() for v in weights.values())
    print(f"HF copy written: {out} ({n} parameters, f32)", file=sys.stderr)


# Qwen2.5-0.5B's published config (the model of verl's quickstart): what `--model
# qwen2.5-0.5b-shape` builds with random weights.
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cmd_prepare_shape(a) -> None:
    """A random-weight model of Qwen2.5-0.5B's shape written by transformers (f32, seed 0), with
    a byte-level BPE tokenizer of 8,192 tokens trained on the GSM8K questions and answers of
    --data (Qwen2.5's own tokenizer is not on PyPI; this one cuts a GSM8K prompt into about as
    many tokens) and ChatML: the same files for both sides, a chat model TRL can train."""
    import pyarrow.parquet as pq
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    out = Path(a.out)
    stamp = json.dumps({"shape": QWEN25_05B, "data": str(Path(a.data).resolve()), "vocab": 8192, "split": QWEN2_SPLIT})
    if up_to_date(out, stamp):
        print(f"model up to date: {out}", file=sys.stderr)
        return
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    rows = pq.read_table(a.data).to_pylist()
    texts = []
    for r in rows:
        texts += [m["content"] for m in r["prompt"]]
        texts.append(str((r.get("extra_info") or {}).get("answer", "")))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    # Qwen2's own normaliser and pre-tokenizer (transformers 5 rebuilds a `qwen2` model's
    # tokenizer with them whatever tokenizer.json says; main_ppo reads tokenizer.json): NFC,
    # its split pattern (digits one by one), bytes to characters.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    fast.save_pretrained(str(tmp))
    eos, pad = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**QWEN25_05B, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config.eos_token_id = [eos, pad]
    model.save_pretrained(str(tmp), safe_serialization=True)
    publish(tmp, out, stamp)
    n = sum(p.numel() for p in model.parameters())
    print(f"model written: {out} ({n} parameters, f32; tokenizer {fast.vocab_size} tokens)", file=sys.stderr)


def cmd_check(a) -> None:
    """Same weights on both sides: the prompt's ids, the logits at its last position and a greedy
    continuation, compared with what our bench wrote to --ours."""
    torch = torch_setup(a.threads)
    model, tok, load_s = load_model(a.hf)
    model.eval()
    ours = json.loads(Path(a.ours).read_text())
    text = Path(a.prompt).read_text()
    ids = tok(text, add_special_tokens=False).input_ids
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(input_ids=x).logits[0, -1].float()
        mine = torch.tensor(ours["last_logits"], dtype=torch.float32)
        diff = (logits - mine).abs()
        no_eos(model)
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=len(ours["greedy_ids"]),
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    greedy = out[0, len(ids):].tolist()
    same = 0
    for p, q in zip(greedy, ours["greedy_ids"]):
        if p != q:
            break
        same += 1
    emit(
        {
            **base(a.threads, load_s),
            "what": "check",
            "prompt_ids_equal": ids == ours["prompt_ids"],
            "prompt_tokens": len(ids),
            "logits_max_abs_diff": diff.max().item(),
            "logits_max_abs": logits.abs().max().item(),
            "argmax_equal": int(logits.argmax()) == int(mine.argmax()),
            "greedy_ids": greedy,
            "greedy_common_prefix": same,
            "greedy_len": len(ours["greedy_ids"]),
        }
    )


def cmd_fwdbwd(a) -> None:
    """Forward + backward of the mean log-probability of every token of a [batch, seq] batch,
    written as a PyTorch user would (full logits, log_softmax, gather)."""
    torch = torch_setup(a.threads)
    model, _, load_s = load_model(a.hf)
    model.train()
    if a.checkpointing:
        # Per-layer recomputation, as verl's enable_gradient_checkpointing asks of transformers.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    b, t = a.batch, a.seq
    # The same ids as our side: (i * 7919) mod 49000 over the row-major [b, t] grid.
    ids = (torch.arange(b * t, dtype=torch.int64) * 7919 % 49000).view(b, t)
    mask = torch.ones_like(ids)
    fwd, bwd, loss_v = [], [], 0.0
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast_bf16)
    for i in range(a.warmup + a.reps):
        t0 = time.perf_counter()
        with amp:
            logits = model(input_ids=ids, attention_mask=mask).logits  # [b, t, vocab]
        lp = logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [b, t]
        loss = -lp.mean()
        f = time.perf_counter() - t0
        loss.backward()
        total = time.perf_counter() - t0
        loss_v = loss.item()
        del logits, lp, loss
        model.zero_grad(set_to_none=True)
        if i >= a.warmup:
            fwd.append(f)
            bwd.append(total - f)
    secs = [x + y for x, y in zip(fwd, bwd)]
    mean = sum(secs) / len(secs)
    emit(
        {
            **base(a.threads, load_s),
            "what": "fwdbwd",
            "batch": b,
            "seq": t,
            "warmup": a.warmup,
            "reps": a.reps,
            "seconds": secs,
            "forward_s": sum(fwd) / len(fwd),
            "backward_s": sum(bwd) / len(bwd),
            "tokens_per_s": b * t / mean,
            "loss": loss_v,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "autocast_bf16": a.autocast_bf16,
            "gradient_checkpointing": bool(a.checkpointing),
        }
    )


def cmd_gen(a) -> None:
    """transformers' generate(): greedy, batch copies of the prompt, EOS ignored, KV cache,
    prefill included in the time; a short untimed warm-up first."""
    torch = torch_setup(a.threads)
    model, tok, load_s = load_model(a.hf)
    model.eval()
    no_eos(model)
    ids = tok(Path(a.prompt).read_text(), add_special_tokens=False).input_ids
    x = torch.tensor([ids] * a.batch)
    m = torch.ones_like(x)
    kw = dict(input_ids=x, attention_mask=m, do_sample=False, pad_token_id=tok.pad_token_id)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast_bf16)
    with torch.inference_mode(), amp:
        if a.warmup_new > 0:
            model.generate(max_new_tokens=a.warmup_new, **kw)
        t0 = time.perf_counter()
        out = model.generate(max_new_tokens=a.new, **kw)
        secs = time.perf_counter() - t0
    resp = out[:, len(ids):]
    tokens = int(resp.numel())
    emit(
        {
            **base(a.threads, load_s),
            "what": "gen",
            "batch": a.batch,
            "new": a.new,
            "seconds": secs,
            "tokens": tokens,
            "tokens_per_s": tokens / secs,
            "row0_ids": resp[0].tolist(),
            "autocast_bf16": a.autocast_bf16,
            "gradient_checkpointing": bool(a.checkpointing),
        }
    )


def cmd_adamw(a) -> None:
    """torch.optim.AdamW over every parameter (random gradients), with the implementation
    PyTorch picks by default on this device, then with fused=True for reference."""
    torch = torch_setup(a.threads)
    model, _, load_s = load_model(a.hf)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    res = {}
    for name, extra in (("default", {}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(
            params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **extra
        )
        secs = []
        for i in range(a.warmup + a.reps):
            t0 = time.perf_counter()
            opt.step()
            if i >= a.warmup:
                secs.append(time.perf_counter() - t0)
        res[name] = {"seconds": secs, "step_s": sum(secs) / len(secs)}
        del opt
    emit(
        {
            **base(a.threads, load_s),
            "what": "adamw",
            "params": sum(p.numel() for p in params),
            "tensors": len(params),
            "warmup": a.warmup,
            "reps": a.reps,
            "step_s": res["default"]["step_s"],
            "seconds": res["default"]["seconds"],
            "fused_step_s": res["fused"]["step_s"],
            "default_impl": "foreach=None, fused=None: PyTorch's choice (its foreach kernels "
            "are for accelerators, so on CPU the per-tensor loop)",
        }
    )


# verl's GSM8K scorer (verl/utils/reward_score/gsm8k.py, strict method), as main_ppo's built-in
# `openai/gsm8k` scorer: the last "#### <number>" in the response's last 300 characters,
# commas removed, must equal the ground truth; 1.0 then, else 0.0 (format_score 0).
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_score(solution: str, ground_truth: str) -> float:
    found = _GSM8K_STRICT.findall(solution[-300:])
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").replace("$", "")
    return 1.0 if answer == ground_truth else 0.0


def gsm8k_reward(completions, reward_model, **_):
    out = []
    for c, rm in zip(completions, reward_model):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(gsm8k_score(text, str(rm["ground_truth"])))
    return out


# `--optim`: the optimizer on both sides of the GRPO run. TRL's names (transformers'
# OptimizerNames; the low-bit ones build torchao's AdamW8bit / AdamW4bit with 256-value blocks)
# and ours (verl's optim.optimizer_impl / optim.optimizer, the same torchao classes).
OPTIMS = {
    "adamw": (None, []),  # TRL's default optimizer, as every earlier run
    "adamw8bit": (
        "adamw_torch_8bit",
        ["actor_rollout_ref.actor.optim.optimizer_impl=torchao.optim",
         "actor_rollout_ref.actor.optim.optimizer=AdamW8bit"],
    ),
    "adamw4bit": (
        "adamw_torch_4bit",
        ["actor_rollout_ref.actor.optim.optimizer_impl=torchao.optim",
         "actor_rollout_ref.actor.optim.optimizer=AdamW4bit",
         # transformers passes block_size 256 to AdamW4bit (torchao's own default is 128)
         "+actor_rollout_ref.actor.optim.override_optimizer_config.block_size=256"],
    ),
}


def optimizer_class(trainer) -> str:
    """The optimizer class TRL trained with (inside accelerate's wrapper)."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return f"{type(opt).__module__}.{type(opt).__name__}"


def cmd_grpo(a) -> None:
    """TRL's GRPOTrainer: 8 prompts x 4 responses per step, <= max_new tokens, beta 0, lr 1e-6,
    f32 on the CPU; wall time of each step (between step ends) and peak RSS."""
    torch = torch_setup(a.threads)
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok, load_s = load_model(a.hf)
    ds = load_dataset("parquet", data_files=a.data, split="train")
    ds = ds.select_columns(["prompt", "reward_model"])

    class Timer(TrainerCallback):
        def __init__(self):
            self.t = None
            self.steps: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.steps.append(now - self.t)
            self.t = now
            print(f"TRL step {len(self.steps)}: {self.steps[-1]:.1f} s", file=sys.stderr, flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append(dict(logs))

    cfg = GRPOConfig(
        output_dir=a.out,
        per_device_train_batch_size=32,
        num_generations=4,
        max_completion_length=a.max_new,
        beta=0.0,
        learning_rate=1e-6,
        **({"optim": OPTIMS[a.optim][0]} if OPTIMS[a.optim][0] else {}),
        bf16=False,
        fp16=False,
        use_cpu=True,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=a.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[gsm8k_reward],
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.train()

    def series(key):
        return [l[key] for l in timer.logs if key in l]

    emit(
        {
            **base(a.threads, load_s),
            "what": "grpo",
            "step_s": timer.steps,
            "completion_mean_length": series("completions/mean_length"),
            "reward_mean": series("reward"),
            "trl_step_time": series("step_time"),
            "settings": {
                "per_device_train_batch_size": cfg.per_device_train_batch_size,
                "num_generations": cfg.num_generations,
                "max_completion_length": cfg.max_completion_length,
                "beta": cfg.beta,
                "learning_rate": cfg.learning_rate,
                "loss_type": cfg.loss_type,
                "num_iterations": cfg.num_iterations,
                "gradient_checkpointing": cfg.gradient_checkpointing,
                "bf16": cfg.bf16,
                "temperature": cfg.temperature,
                "optim": str(cfg.optim),
                "optimizer_class": optimizer_class(trainer),
            },
        }
    )


# ---------------------------------------------------------------------------------------------
# the driver


def run_measured(argv: list[str], env: dict, log: Path, timeout: float | None = None) -> dict:
    """Runs one measurement under /usr/bin/time -v; returns its RESULT (plus the outer peak RSS
    and wall time). The full output goes to `log`."""
    timev = ["/usr/bin/time", "-v"] if os.path.exists("/usr/bin/time") else []
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        p = subprocess.run(
            timev + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=timeout,
        )
        f.write(p.stdout)
    wall = time.perf_counter() - t0
    result = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    if p.returncode != 0 or result is None:
        tail = "\n".join(p.stdout.splitlines()[-15:])
        raise RuntimeError(f"{' '.join(argv[:3])}... failed (exit {p.returncode}); log {log}:\n{tail}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stdout)
    result["time_v_max_rss_bytes"] = int(m.group(1)) * 1024 if m else None
    result["process_wall_s"] = wall
    return result


def run_ours_grpo(a, env: dict, out: Path, log: Path) -> dict:
    jsonl = out / "ours_grpo.jsonl"
    if jsonl.exists():
        jsonl.unlink()
    overrides = ours_grpo_overrides(a, out)
    env = dict(env, VERL_FILE_LOGGER_PATH=str(jsonl))
    timev = ["/usr/bin/time", "-v"] if os.path.exists("/usr/bin/time") else []
    argv = [a.ours_bin] + overrides
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        p = subprocess.run(timev + argv, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    text = log.read_text()
    if p.returncode != 0 or not jsonl.is_file():
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"main_ppo GRPO run failed (exit {p.returncode}); log {log}:\n{tail}")
    steps = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()]
    data = [s["data"] for s in steps]
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {
        "side": "main_ppo",
        "what": "grpo",
        "step_s": [d.get("timing_s/step") for d in data],
        "completion_mean_length": [d.get("response_length/mean") for d in data],
        "reward_mean": [d.get("critic/score/mean") for d in data],
        "max_memory_rss_gb": [d.get("perf/max_memory_rss_gb") for d in data],
        "timing": [{k: v for k, v in d.items() if k.startswith("timing_s/")} for d in data],
        "peak_rss_bytes": max((d.get("perf/max_memory_rss_gb") or 0) for d in data) * GIB,
        "time_v_max_rss_bytes": int(m.group(1)) * 1024 if m else None,
        "process_wall_s": wall,
        "overrides": overrides,
    }


def ours_grpo_overrides(a, out: Path) -> list[str]:
    return [
        f"data.train_files={a.data}",
        f"data.val_files={a.data}",
        "data.train_batch_size=8",
        "data.max_prompt_length=512",
        f"data.max_response_length={a.grpo_max_new}",
        f"actor_rollout_ref.model.path={a.gguf}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={a.micro_batch}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.total_training_steps={a.grpo_steps}",
        "trainer.logger=['console','file']",
        "trainer.project_name=bench_vs_torch",
        "trainer.experiment_name=grpo",
        f"trainer.default_local_dir={out / 'ours_grpo_ckpt'}",
        "trainer.device=cpu",
        f"trainer.seed={a.seed}",
    ] + (
        [
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
            "actor_rollout_ref.rollout.dtype=bfloat16",
        ]
        if a.precision == "bf16"
        else []
    ) + OPTIMS[a.optim][1] + list(a.ours_override)


PROMPT = (
    "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether in April and May?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# Gemma 3 270M is a base model: the question as it continues text.
PROMPT_BASE = (
    "<bos>Question: Natalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer:"
)

ALL = ["fwdbwd", "gen", "adamw", "grpo"]


def fmt(v, unit: str) -> str:
    if v is None:
        return "failed"
    if unit == "GiB":
        return f"{v / GIB:.2f}"
    if unit == "s" and v < 10:
        return f"{v:.3f}"
    return f"{v:.1f}"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def first_divergence(a: list[int], b: list[int]) -> str:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return f"first difference at token {i + 1} of {n}"
    return f"{n}/{n} tokens identical"


def isa_env(cpu: str) -> dict:
    """The environment that narrows both sides to one instruction set: main_ppo's
    MAIN_PPO_CPU, and PyTorch's ATen kernels (ATEN_CPU_CAPABILITY), MKL (MKL_ENABLE_INSTRUCTIONS)
    and oneDNN (ONEDNN_MAX_CPU_ISA). `auto` changes nothing."""
    if cpu == "auto":
        return {}
    if cpu == "avx2":
        return {
            "MAIN_PPO_CPU": "avx2",
            "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
        }
    sys.exit(f"bench_vs_torch: --cpu must be auto or avx2, got `{cpu}`")


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo names it (virtual machines may give a generic name), its
    family/model and the SIMD extensions that matter for these kernels."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        return "unknown CPU"
    flags = set(fields.get("flags", "").split())
    simd = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return (
        f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} "
        f"model {fields.get('model', '?')}; {', '.join(simd) or 'no AVX2'})"
    )


def cmd_run(a) -> None:
    only = ALL if not a.only else [x.strip() for x in a.only.split(",") if x.strip()]
    for x in only:
        if x not in ALL:
            sys.exit(f"bench_vs_torch: --only: unknown measurement `{x}` (expected {', '.join(ALL)})")
    quick = a.quick
    a.grpo_steps = 2 if quick else 3
    a.grpo_max_new = 128
    out = Path(a.results)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    prompt = out / "prompt.txt"
    prompt.write_text(PROMPT_BASE if a.model == "gemma3" else PROMPT)
    threads = str(a.threads)
    env = dict(
        os.environ,
        RAYON_NUM_THREADS=threads,
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        TOKENIZERS_PARALLELISM="false",
        TQDM_DISABLE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(isa_env(a.cpu))
    py = [sys.executable, os.path.abspath(__file__)]
    common_py = ["--hf", a.hf, "--threads", threads]
    common_rs = ["--model", a.gguf, "--prompt", str(prompt)]

    import torch
    import transformers
    import trl

    cpu = cpu_description()
    torch_isa = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, stdout=subprocess.PIPE, text=True, check=False,
    ).stdout.strip()
    # PyTorch's bf16 autocast on a CPU without bf16 instructions (or with them forced off)
    # emulates bf16 and runs many times slower than f32: its rows would take many minutes and
    # prove nothing, so they are left out, saying why.
    native_bf16 = a.cpu != "avx2" and any(x in cpu for x in ("avx512_bf16", "amx_bf16"))
    info = {
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": a.model,
        "threads": a.threads,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ours_rev": a.ours_rev,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "model": a.gguf,
        "hf_copy": a.hf,
        "quick": quick,
        "only": only,
        "micro_batch": a.micro_batch,
        "precision": a.precision,
        "optim": a.optim,
        "cpu_forced": a.cpu,
        "torch_cpu_capability": torch_isa,
    }
    print(
        f"threads: {a.threads} on both sides (RAYON_NUM_THREADS, torch.set_num_threads); "
        f"CPU: {cpu} ({os.cpu_count()} cores)\n"
        f"main_ppo {a.ours_rev}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}\n"
        + (f"instruction sets forced to {a.cpu} on both sides (MAIN_PPO_CPU; ATEN_CPU_CAPABILITY, "
           f"MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA): torch reports {torch_isa}\n" if a.cpu != "auto" else ""),
        flush=True,
    )
    if a.precision == "bf16" and not native_bf16:
        print("PyTorch's bf16 autocast rows are left out: this CPU (or the forced instruction set) has "
              "no bf16 instructions, and PyTorch's emulated bf16 runs many times slower than its f32 "
              "(the f32 rows are the baseline)\n", flush=True)
    res: dict = {"info": info}

    def measure(key: str, argv: list[str]):
        print(f"-- {key} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        try:
            r = run_measured(argv, env, logs / f"{key}.log")
            print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # one failed side must not lose the others
            print(f"FAILED\n{e}", flush=True)
            r = {"error": str(e)}
        res[key] = r
        return r

    # Same weights on both sides: our logits and greedy continuation, compared by PyTorch.
    check_new = 16 if quick else 32
    ours_check = out / "ours_check.json"
    measure("check_ours", [a.ours_bench, "check", "--out", str(ours_check), "--new", str(check_new)] + common_rs)
    if ours_check.is_file():
        c = measure("check_pytorch", py + ["check", "--ours", str(ours_check), "--prompt", str(prompt)] + common_py)
        if "error" not in c:
            print(
                f"same weights: prompt {c['prompt_tokens']} tokens, ids equal: {'yes' if c['prompt_ids_equal'] else 'NO'}; "
                f"last-position logits max |diff| {c['logits_max_abs_diff']:.2e} (max |logit| {c['logits_max_abs']:.1f}), "
                f"argmax equal: {'yes' if c['argmax_equal'] else 'NO'}; greedy continuation: "
                f"{c['greedy_common_prefix']}/{c['greedy_len']} tokens identical",
                flush=True,
            )

    fb = ["--batch", "8", "--seq", "256", "--warmup", "1", "--reps", "1" if quick else "2"]
    gen_new = "32" if quick else "128"
    gn = ["--batch", "32", "--new", gen_new, "--warmup-new", "4"]
    # AdamW is memory-bound and short (tens of ms): enough repetitions that the VM's bandwidth
    # noise averages out on both sides.
    ad = ["--warmup", "2", "--reps", "2" if quick else "10"]
    bf16 = a.precision == "bf16"
    ours_prec = ["--bf16", "1" if bf16 else "0"]
    if "fwdbwd" in only:
        # Like for like: PyTorch keeps every activation, so ours does too (`--checkpointing 0`);
        # training's default, per-layer recomputation (verl's enable_gradient_checkpointing),
        # is measured as extra rows against the same PyTorch run.
        measure("fwdbwd_ours", [a.ours_bench, "fwdbwd", "--checkpointing", "0"] + fb + ours_prec + common_rs)
        measure("fwdbwd_ours_recompute", [a.ours_bench, "fwdbwd", "--checkpointing", "1"] + fb + ours_prec + common_rs)
        measure("fwdbwd_pytorch", py + ["fwdbwd"] + fb + common_py)
        if bf16 and native_bf16:
            measure("fwdbwd_pytorch_bf16", py + ["fwdbwd", "--autocast-bf16"] + fb + common_py)
    if "gen" in only:
        measure("gen_ours", [a.ours_bench, "gen"] + gn + ours_prec + common_rs)
        measure("gen_pytorch", py + ["gen", "--prompt", str(prompt)] + gn + common_py)
        if bf16 and native_bf16:
            measure("gen_pytorch_bf16", py + ["gen", "--autocast-bf16", "--prompt", str(prompt)] + gn + common_py)
        o, t = res["gen_ours"], res["gen_pytorch"]
        if "row0_ids" in o and "row0_ids" in t:
            print(f"generation row 0, ours vs transformers: {first_divergence(o['row0_ids'], t['row0_ids'])}", flush=True)
    if "adamw" in only:
        measure("adamw_ours", [a.ours_bench, "adamw"] + ad + common_rs)
        measure("adamw_pytorch", py + ["adamw"] + ad + common_py)
    if "grpo" in only:
        print("-- grpo_ours ...", end=" ", flush=True)
        t0 = time.perf_counter()
        try:
            res["grpo_ours"] = run_ours_grpo(a, env, out, logs / "grpo_ours.log")
            print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:
            print(f"FAILED\n{e}", flush=True)
            res["grpo_ours"] = {"error": str(e)}
        measure(
            "grpo_trl",
            py + ["grpo", "--data", a.data, "--out", str(out / "trl_grpo"), "--steps", str(a.grpo_steps),
                  "--max-new", str(a.grpo_max_new), "--seed", str(a.seed), "--optim", a.optim] + common_py,
        )

    rows = table_rows(res, only, quick, gen_new)
    md = render(rows, info)
    print("\n" + md, flush=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, **res}, indent=1))
    (out / "results.md").write_text(md + "\n")
    print(f"\nwritten: {out / 'results.md'}, {out / 'results.json'}, logs in {logs}", flush=True)


def table_rows(res: dict, only: list[str], quick: bool, gen_new: str) -> list[dict]:
    rows = []

    def get(key, field):
        r = res.get(key) or {}
        return r.get(field)

    def row(metric, unit, better, ours, theirs, note=""):
        ratio = ours / theirs if ours is not None and theirs not in (None, 0) else None
        rows.append({"metric": metric, "unit": unit, "better": better, "ours": ours,
                     "theirs": theirs, "ratio": ratio, "note": note})

    if "fwdbwd" in only:
        row("forward+backward 8x256", "tokens/s", "higher",
            get("fwdbwd_ours", "tokens_per_s"), get("fwdbwd_pytorch", "tokens_per_s"),
            "both sides keep every activation")
        row("forward+backward 8x256, peak RSS", "GiB", "lower",
            get("fwdbwd_ours", "peak_rss_bytes"), get("fwdbwd_pytorch", "peak_rss_bytes"))
        if "fwdbwd_pytorch_bf16" in res:
            row("forward+backward 8x256 vs torch bf16 autocast", "tokens/s", "higher",
                get("fwdbwd_ours", "tokens_per_s"), get("fwdbwd_pytorch_bf16", "tokens_per_s"))
        row("forward+backward 8x256, ours with per-layer recomputation", "tokens/s", "higher",
            get("fwdbwd_ours_recompute", "tokens_per_s"), get("fwdbwd_pytorch", "tokens_per_s"),
            "training's default; PyTorch keeps activations")
        row("forward+backward 8x256, ours with per-layer recomputation, peak RSS", "GiB", "lower",
            get("fwdbwd_ours_recompute", "peak_rss_bytes"), get("fwdbwd_pytorch", "peak_rss_bytes"))
    if "gen" in only:
        row(f"greedy generation 32x{gen_new}", "tokens/s", "higher",
            get("gen_ours", "tokens_per_s"), get("gen_pytorch", "tokens_per_s"), "prefill included")
        row(f"greedy generation 32x{gen_new}, peak RSS", "GiB", "lower",
            get("gen_ours", "peak_rss_bytes"), get("gen_pytorch", "peak_rss_bytes"))
        if "gen_pytorch_bf16" in res:
            row(f"greedy generation 32x{gen_new} vs torch bf16 autocast", "tokens/s", "higher",
                get("gen_ours", "tokens_per_s"), get("gen_pytorch_bf16", "tokens_per_s"), "prefill included")
    if "adamw" in only:
        n = get("adamw_pytorch", "params") or get("adamw_ours", "params")
        size = f"{n / 1e6:.0f}M params" if isinstance(n, (int, float)) else "every parameter"
        row(f"AdamW step, {size}", "s", "lower",
            get("adamw_ours", "step_s"), get("adamw_pytorch", "step_s"), "torch default (for-loop on CPU)")
        row("AdamW step, vs torch fused=True", "s", "lower",
            get("adamw_ours", "step_s"), get("adamw_pytorch", "fused_step_s"))
    if "grpo" in only:
        timed = slice(1, None)  # steps 2.. (step 1 warms up)
        o = (res.get("grpo_ours") or {}).get("step_s") or []
        t = (res.get("grpo_trl") or {}).get("step_s") or []
        steps = "step 2" if quick else "steps 2-3"
        row(f"GRPO step, 8x4 responses <= 128 tokens, mean of {steps}", "s", "lower", mean(o[timed]), mean(t[timed]),
            f"ours {' / '.join(f'{x:.1f}' for x in o)}; TRL {' / '.join(f'{x:.1f}' for x in t)}")
        gc = ((res.get("grpo_trl") or {}).get("settings") or {}).get("gradient_checkpointing")
        row("GRPO peak RSS", "GiB", "lower", get("grpo_ours", "peak_rss_bytes"), get("grpo_trl", "peak_rss_bytes"),
            f"ours micro-batch {res['info']['micro_batch']}; TRL gradient_checkpointing={gc} (its default); "
            f"optimizer {res['info'].get('optim', 'adamw')} on both sides")
        ol = (res.get("grpo_ours") or {}).get("completion_mean_length") or []
        tl = (res.get("grpo_trl") or {}).get("completion_mean_length") or []
        row(f"GRPO mean response length, {steps}", "tokens", "-", mean(ol[timed]), mean(tl[timed]),
            "context: longer responses cost more")
    return rows


def render(rows: list[dict], info: dict) -> str:
    lines = [
        f"main_ppo ({info['ours_rev']}, {info.get('precision', 'fp32')} products) vs PyTorch {info['torch']} / transformers {info['transformers']} / "
        f"TRL {info['trl']}, {info['threads']} threads each, {info['cpu']}, {info['when_utc']}"
        + (" (quick mode)" if info["quick"] else ""),
        "",
        "| metric | main_ppo | PyTorch/TRL | ours/theirs | better | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        unit = r["unit"]
        lines.append(
            f"| {r['metric']} ({unit}) | {fmt(r['ours'], unit)} | {fmt(r['theirs'], unit)} | {ratio} | "
            f"{r['better']} | {r['note']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def worker(name, fn):
        s = sub.add_parser(name)
        s.add_argument("--hf", required=True)
        s.add_argument("--threads", type=int, default=os.cpu_count() or 1)
        s.set_defaults(fn=fn)
        return s

    s = sub.add_parser("prepare-hf")
    s.add_argument("--gguf", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_prepare_hf)

    s = sub.add_parser("prepare-shape")
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_prepare_shape)

    s = worker("check", cmd_check)
    s.add_argument("--ours", required=True)
    s.add_argument("--prompt", required=True)

    s = worker("fwdbwd", cmd_fwdbwd)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--seq", type=int, default=256)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--reps", type=int, default=2)
    s.add_argument("--autocast-bf16", action="store_true", help="run under torch.autocast(bfloat16)")
    s.add_argument("--checkpointing", type=int, default=0,
                   help="1: recompute each layer in backward (transformers' gradient checkpointing)")

    s = worker("gen", cmd_gen)
    s.add_argument("--prompt", required=True)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--new", type=int, default=128)
    s.add_argument("--warmup-new", type=int, default=4)
    s.add_argument("--autocast-bf16", action="store_true", help="run under torch.autocast(bfloat16)")
    s.add_argument("--checkpointing", type=int, default=0,
                   help="1: recompute each layer in backward (transformers' gradient checkpointing)")

    s = worker("adamw", cmd_adamw)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--reps", type=int, default=3)

    s = worker("grpo", cmd_grpo)
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--max-new", type=int, default=128)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--optim", choices=sorted(OPTIMS), default="adamw")

    s = sub.add_parser("run")
    s.add_argument("--ours-bench", required=True, help="the built benches/vs_torch.rs executable")
    s.add_argument("--ours-bin", required=True, help="the main_ppo release binary")
    s.add_argument("--ours-rev", default="?")
    s.add_argument("--model", choices=["smollm2", "gemma3", "qwen2.5-0.5b-shape"], default="smollm2")
    s.add_argument("--gguf", required=True)
    s.add_argument("--hf", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--results", required=True)
    s.add_argument("--only", default="")
    s.add_argument("--quick", action="store_true")
    s.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    s.add_argument("--micro-batch", type=int, default=8)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--ours-override", action="append", default=[])
    s.add_argument("--optim", choices=sorted(OPTIMS), default="adamw",
                   help="the GRPO run's optimizer on both sides (adamw: torch's; adamw8bit, adamw4bit: torchao's)")
    s.add_argument("--cpu", choices=["auto", "avx2"], default="auto",
                   help="instruction sets of both sides: the CPU's widest (auto) or AVX2 + FMA (avx2)")
    s.set_defaults(fn=cmd_run)

    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
