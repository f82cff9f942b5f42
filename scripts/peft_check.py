"""Our LoRA adapters against PEFT (run through scripts/peft_check.sh, which makes the venv).

check: on an HF copy of SmolLM2,
  1. ours -> PEFT: main_ppo trains one GRPO step with LoRA and saves `lora_adapter/`; PEFT loads
     it onto transformers' model; greedy text must be identical, every generated token's
     log-probability must agree within 1e-4 (log_softmax of the logits at each position), and
     so must the logits at every position of prompt + response (our forward through
     examples/hidden_states, unmerged and merged; printed layer by layer);
  2. PEFT -> ours: PEFT writes an adapter with random A and B; `main_ppo generate` with
     `lora_adapter_path` must give the same greedy text and log-probabilities.
make-fixture DIR: a tiny Llama base and a PEFT adapter for it (random A and B, rsLoRA, a list of
  targets and an exclusion), with PEFT's logits on fixed input ids: the Rust test
  `weights::peft::tests::reads_a_peft_adapter_fixture` reads it.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
]
MAX_NEW = 40
# Both sides compute in f64 by default. transformers does not, even in an f64 model: its
# LlamaRMSNorm casts to f32 and its RoPE tables are computed in f32; `true_f64` swaps both for
# f64 versions of the same formulas. Measured (2026-12-01, SmolLM2, no adapter): without that,
# every layer differed by ~1e-5..1e-3 and the logits by 2.4e-5; with it, 1e-11 per layer and
# 2.5e-13 in the logits. The log-prob gap of 2.6e-4 seen before came from our log-softmax
# summing the vocabulary in f32 (fixed). In f32 both sides round differently: the logits then
# differ by ~1e-4 (each ~0.6-1e-4 from the f64 values).
DTYPE = torch.float64
TOL = 1e-4


def true_f64(model):
    """In an f64 model, transformers' f32 steps (RMSNorm's upcast, the RoPE tables) made f64."""
    if DTYPE != torch.float64:
        return model
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            def norm(x, mod=mod):
                var = x.pow(2).mean(-1, keepdim=True)
                return mod.weight * (x * torch.rsqrt(var + mod.variance_epsilon))
            mod.forward = norm
        if type(mod).__name__.endswith("RotaryEmbedding"):
            cfg = mod.config
            rp = getattr(cfg, "rope_parameters", None) or {}
            if rp.get("rope_type", "default") != "default":
                print("note: RoPE scaling in use; transformers' f32 RoPE tables kept")
                continue
            theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
            hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            def rope(x, position_ids, inv=inv):
                f = position_ids[..., None].double() * inv
                e = torch.cat((f, f), -1)
                return e.cos().to(x.dtype), e.sin().to(x.dtype)
            mod.forward = rope
    return model


def make_fixture(out: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(out / "base", safe_serialization=True)
    ids = torch.tensor([[3, 7, 1, 9, 4, 2, 60, 33]])
    with torch.no_grad():
        base_logits = model(ids).logits[0]
    lcfg = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        exclude_modules=r".*layers\.1\.self_attn\.v_proj",
        init_lora_weights=False, lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, lcfg).eval()
    peft_model.save_pretrained(out / "adapter", safe_serialization=True)
    with torch.no_grad():
        logits = peft_model(ids).logits[0]
    (out / "expected.json").write_text(json.dumps({
        "made_by": "scripts/peft_check.py make-fixture (torch %s, peft %s)" % (
            torch.__version__, __import__("peft").__version__),
        "input_ids": ids[0].tolist(),
        "logits": logits.tolist(),
        "base_logits": base_logits.tolist(),
    }))
    print("fixture written to", out)


def peft_greedy(model, tok, prompt):
    """Greedy continuation of the chat-formatted prompt: text, each token's log-prob, and the
    whole sequence's ids (prompt and response)."""
    model = model.to(DTYPE)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    eos = set([tok.eos_token_id] if isinstance(tok.eos_token_id, int) else tok.eos_token_id)
    out, lps = [], []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(ids).logits[0, -1].double()
            lsm = torch.log_softmax(logits, -1)
            t = int(torch.argmax(logits))
            out.append(t)
            lps.append(float(lsm[t]))
            if t in eos:
                break
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
    full = ids[0].tolist() + ([out[-1]] if out and out[-1] in eos else [])
    return tok.decode(out, skip_special_tokens=True), lps, full


def ours_greedy(main_ppo, model_dir, adapter, work: Path):
    inp = work / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    outp = work / "ours.jsonl"
    cmd = [main_ppo, "generate", "--input", str(inp), "--output", str(outp), "--log-probs",
           "--dtype", "f64" if DTYPE == torch.float64 else "f32",
           f"actor_rollout_ref.model.path={model_dir}",
           f"actor_rollout_ref.model.lora_adapter_path={adapter}",
           "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.n=1",
           f"data.max_response_length={MAX_NEW}", "data.max_prompt_length=256", "trainer.device=cpu"]
    subprocess.run(cmd, check=True)
    rows = [json.loads(l) for l in outp.read_text().splitlines()]
    return [(r["responses"][0], r["response_log_probs"][0]) for r in rows]


def peft_stages(model, ids):
    """PEFT's embedding output, each layer's output, the final norm's output and the logits."""
    inner = model.get_base_model().model
    st = []
    hooks = [inner.embed_tokens.register_forward_hook(lambda m, i, o: st.append(o))]
    for layer in inner.layers:
        hooks.append(layer.register_forward_hook(
            lambda m, i, o: st.append(o[0] if isinstance(o, tuple) else o)))
    hooks.append(inner.norm.register_forward_hook(lambda m, i, o: st.append(o)))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    for h in hooks:
        h.remove()
    return [x[0].double() for x in st], logits[0].double()


def compare_logits(name, peft_model, seqs, stages_bin, model_dir, adapter, work: Path, merged=False):
    """Our forward (examples/hidden_states) on `seqs` against PEFT's, stage by stage."""
    from safetensors.torch import load_file

    ids = work / "ids.json"
    ids.write_text(json.dumps(seqs))
    out = work / "ours_stages.safetensors"
    cmd = [stages_bin, "--model", model_dir, "--adapter", str(adapter), "--ids", str(ids), "--out", str(out),
           "--dtype", "f64" if DTYPE == torch.float64 else "f32"] + (["--merged"] if merged else [])
    subprocess.run(cmd, check=True)
    ours = load_file(str(out))
    worst = 0.0
    for k, seq in enumerate(seqs):
        st, logits = peft_stages(peft_model, seq)
        d = [float((ours[f"seq{k}.stage{i}"].double() - st[i]).abs().max()) for i in range(len(st))]
        ld = float((ours[f"seq{k}.logits"].double() - logits).abs().max())
        worst = max(worst, ld)
        print(f"  [{name}] sequence {k} ({len(seq)} tokens): max |diff| embedding {d[0]:.1e}, layers "
              f"{' '.join(f'{x:.0e}' for x in d[1:-1])}, final norm {d[-1]:.1e}, logits {ld:.2e}")
    if DTYPE == torch.float32:
        # Not a pass/fail figure in f32: each side's rounding alone moves SmolLM2's logits by
        # 0.6-1e-4 from the f64 values (measured 2026-12-01: transformers 5.7e-5..6.6e-5, ours
        # 7.2e-5..1.0e-4), so the two differ by up to their sum. The f64 run is the check.
        print(f"{name}: max |logit diff| {worst:.2e} (f32: rounding on both sides; the f64 run checks to {TOL})")
        return True
    ok = worst <= TOL
    print(f"{name}: max |logit diff| {worst:.2e} (tolerance {TOL}) -> {'PASS' if ok else 'FAIL'}")
    return ok


def compare(name, peft_model, tok, ours, stages=None):
    """Greedy texts and token log-probs (generate) and, with `stages` = (binary, model dir,
    adapter, work dir), the logits of every position of prompt + PEFT's greedy response."""
    worst, same, seqs = 0.0, 0, []
    for p, (text, lps) in zip(PROMPTS, ours):
        ptext, plps, pids = peft_greedy(peft_model, tok, p)
        seqs.append(pids)
        n = min(len(lps), len(plps))
        d = max((abs(a - b) for a, b in zip(lps[:n], plps[:n])), default=0.0)
        worst = max(worst, d)
        same += text == ptext
        print(f"  [{name}] same text: {text == ptext}; tokens {len(lps)} vs {len(plps)}; max |log-prob diff| {d:.2e}")
        print(f"    ours: {text[:100]!r}")
        if text != ptext:
            print(f"    peft: {ptext[:100]!r}")
    ok = same == len(PROMPTS) and worst <= TOL
    print(f"{name}: {same}/{len(PROMPTS)} identical greedy texts, max |log-prob diff| {worst:.2e} (tolerance {TOL}) -> {'PASS' if ok else 'FAIL'}")
    if stages is not None:
        stages_bin, model_dir, adapter, work = stages
        ok = compare_logits(name, peft_model, seqs, stages_bin, model_dir, adapter, work) and ok
        ok = compare_logits(name + " (ours merged)", peft_model, seqs, stages_bin, model_dir, adapter, work,
                            merged=True) and ok
    return ok


def check(args):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(Path(args.model).expanduser())
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = Path(tempfile.mkdtemp(prefix="peft_check_"))
    print("torch", torch.__version__, "peft", __import__("peft").__version__, "transformers", __import__("transformers").__version__)
    print("work dir", work)

    # 1. ours -> PEFT: one GRPO step with LoRA r=8 (high LR and an entropy bonus so the adapter moves), saved.
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({
        "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": p}],
        "reward_model": {"style": "rule", "ground_truth": "72"}}) + "\n" for p in PROMPTS[:2]))
    ckpt = work / "ckpt"
    subprocess.run([args.main_ppo, f"data.train_files={data}", f"data.val_files={data}",
                    "data.train_batch_size=2", "data.max_prompt_length=256", "data.max_response_length=16",
                    f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.lora_rank=8",
                    "actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.actor.optim.lr=2e-3",
                    # An entropy bonus gives the adapters a gradient even when every reward is 0.
                    "actor_rollout_ref.actor.entropy_coeff=0.1",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                    "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1", "trainer.save_freq=1",
                    "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.logger=[console]",
                    f"trainer.default_local_dir={ckpt}", "trainer.device=cpu"], check=True)
    ours_dir = ckpt / "global_step_1" / "actor" / "lora_adapter"
    print("our adapter:", ours_dir, json.loads((ours_dir / "adapter_config.json").read_text())["target_modules"])
    base = true_f64(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    peft_model = PeftModel.from_pretrained(base, str(ours_dir)).eval()
    ids = tok("The adapter changes these logits.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
        adapted = peft_model(ids).logits
    moved = float((adapted - plain).abs().max())
    print(f"our adapter moves PEFT's logits by up to {moved:.3e}")
    if moved < 1e-2:
        sys.exit("our trained adapter is (nearly) a no-op: nothing would be checked")
    ok1 = compare("ours -> peft", peft_model, tok, ours_greedy(args.main_ppo, model_dir, ours_dir, work),
                  (args.stages, model_dir, ours_dir, work))

    # 2. PEFT -> ours: random A and B (B scaled down so the text stays readable).
    base = true_f64(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    torch.manual_seed(1)
    pm = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear",
                                         init_lora_weights=False)).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    theirs = work / "peft_adapter"
    pm.save_pretrained(str(theirs), safe_serialization=True)
    print("PEFT adapter:", theirs, json.loads((theirs / "adapter_config.json").read_text())["target_modules"])
    ok2 = compare("peft -> ours", pm, tok, ours_greedy(args.main_ppo, model_dir, theirs, work),
                  (args.stages, model_dir, theirs, work))
    print("ALL PASS" if ok1 and ok2 else "SOME CHECK FAILED")
    sys.exit(0 if ok1 and ok2 else 1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("make-fixture")
    f.add_argument("out", type=Path)
    c = sub.add_parser("check")
    c.add_argument("--model", required=True)
    c.add_argument("--main-ppo", required=True)
    c.add_argument("--stages", required=True, help="the hidden_states example's binary")
    c.add_argument("--f32", action="store_true", help="compare in f32 instead of f64")
    a = ap.parse_args()
    if getattr(a, "f32", False):
        global DTYPE
        DTYPE = torch.float32
    if a.cmd == "make-fixture":
        a.out.mkdir(parents=True, exist_ok=True)
        make_fixture(a.out)
    else:
        check(a)


if __name__ == "__main__":
    main()
