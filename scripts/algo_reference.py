#!/usr/bin/env python3
"""Reference values for src/algo (the golden tests in src/algo/golden.rs).

An independent NumPy implementation of verl's formulas as verl defines them
(verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py, verl-project/verl 1dda039),
written for this project. Writes tests/fixtures/algo_golden.json. Run: python3 scripts/algo_reference.py
(needs numpy; CI does not run it, the JSON is committed)."""
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/algo_golden.json"
rng = np.random.default_rng(20261130)


# ---------------------------------------------------------------- masked helpers
def msum(x, m):
    return float(np.where(m != 0, x, 0.0).__mul__(m).sum())


def mmean(x, m):
    return msum(x, m) / (m.sum() + 1e-8)


def mvar(x, m):
    mean = mmean(x, m)
    var = mmean((x - mean) ** 2, m)
    n = m.sum()
    assert n > 1
    return var * n / (n - 1)


def mwhiten(x, m, shift=True):
    mean, var = mmean(x, m), mvar(x, m)
    w = (x - mean) / np.sqrt(var + 1e-8)
    return w if shift else w + mean


def mmean_rows(x, m):
    return (np.where(m != 0, x, 0) * m).sum(-1) / (m.sum(-1) + 1e-8)


# ---------------------------------------------------------------- aggregation
def agg(L, m, mode, scale=None):
    L = np.where(m != 0, L, 0.0)
    if mode == "token-mean":
        return float((L * m).sum() / m.sum())
    if mode == "token-sum":
        return float((L * m).sum())
    rows = (L * m).sum(-1)
    if mode == "seq-mean-token-sum-norm":
        # Every row's token sum added up (no mean over rows), over the constant horizon.
        return float(rows.sum() / (scale if scale is not None else m.shape[-1]))
    if mode == "seq-mean-token-mean":
        rows = rows / (m.sum(-1) + 1e-8)
    seq_mask = (m.sum(-1) > 0).astype(float)
    return float((rows * seq_mask).sum() / seq_mask.sum())


# ---------------------------------------------------------------- estimators
def groups(index):
    g = defaultdict(list)
    for i, k in enumerate(index):
        g[k].append(i)
    return g


def gae(R, V, M, gamma, lam):
    B, T = R.shape
    adv = np.zeros_like(R)
    nextv = np.zeros(B)
    last = np.zeros(B)
    for t in reversed(range(T)):
        delta = R[:, t] + gamma * nextv - V[:, t]
        cand = delta + gamma * lam * last
        nextv = V[:, t] * M[:, t] + (1 - M[:, t]) * nextv
        last = cand * M[:, t] + (1 - M[:, t]) * last
        adv[:, t] = last
    ret = adv + V
    return mwhiten(adv, M), ret


def grpo(R, M, index, norm, eps=1e-6):
    s = R.sum(-1)
    a = s.copy()
    for rows in groups(index).values():
        if len(rows) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = s[rows].mean(), s[rows].std(ddof=1)
        for i in rows:
            a[i] = (s[i] - mean) / (std + eps) if norm else s[i] - mean
    A = a[:, None] * M
    return A, A


def rloo(R, M, index, vectorized=False):
    s = R.sum(-1)
    a = s.copy()
    for rows in groups(index).values():
        n = len(rows)
        if n > 1:
            mean = s[rows].mean()
            for i in rows:
                a[i] = s[i] * n / (n - 1) - mean * n / (n - 1)
        elif vectorized:
            a[rows[0]] = 0.0
    A = a[:, None] * M
    return A, A


def reinforce_pp(R, M, gamma):
    B, T = R.shape
    ret = np.zeros_like(R)
    for b in range(B):
        g = 0.0
        for t in reversed(range(T)):
            if M[b, t] != 0:
                g = R[b, t] + gamma * g
                ret[b, t] = g
    return mwhiten(ret, M) * M, ret


def reinforce_pp_baseline(R, M, index):
    s = R.sum(-1)
    a = s.copy()
    for rows in groups(index).values():
        mean = s[rows].mean() if len(rows) > 1 else 0.0
        for i in rows:
            a[i] = s[i] - mean
    A = np.tile(a[:, None], (1, R.shape[1])) * M
    A = mwhiten(A, M) * M
    return A, A


def remax(R, M, base):
    ret = np.flip(np.cumsum(np.flip(R * M, -1), -1), -1)
    return ret - base[:, None] * M, ret


def opo(R, M, index):
    s = R.sum(-1)
    L = M.sum(-1)
    a = s.copy()
    for rows in groups(index).values():
        b = (L[rows] * s[rows]).sum() / L[rows].sum() if len(rows) > 1 else 0.0
        for i in rows:
            a[i] = s[i] - b
    A = a[:, None] * M
    return A, A


def grpo_passk(R, M, index, norm, eps=1e-6):
    s = R.sum(-1)
    a = np.zeros_like(s)
    for rows in groups(index).values():
        vals = s[rows]
        order = np.argsort(-vals, kind="stable")
        i_max = rows[order[0]]
        adv = vals[order[0]] - vals[order[1]]
        if norm:
            adv = adv / (vals.std(ddof=1) + eps)
        a[i_max] = adv
    A = a[:, None] * M
    return A, A


def gpg(R, M, index):
    s = R.sum(-1)
    alpha = len(s) / max(np.count_nonzero(s), 1)
    a = s.copy()
    for rows in groups(index).values():
        mean = s[rows].mean() if len(rows) > 1 else 0.0
        for i in rows:
            a[i] = alpha * (s[i] - mean)
    A = a[:, None] * M
    return A, A


# ---------------------------------------------------------------- policy losses
def vanilla(old, lp, A, M, p):
    nk = np.clip(lp - old, -20, 20)
    r = np.exp(nk)
    l1 = -A * r
    l2 = -A * np.clip(r, 1 - p["clip_low"], 1 + p["clip_high"])
    c1 = np.maximum(l1, l2)
    l3 = -A * p["clip_ratio_c"]
    c2 = np.minimum(l3, c1)
    L = np.where(A < 0, c2, c1)
    return dict(
        loss=agg(L, M, p["agg"]),
        pg_clipfrac=mmean((l2 > l1).astype(float), M),
        ppo_kl=mmean(-nk, M),
        pg_clipfrac_lower=mmean((c1 > l3).astype(float) * (A < 0), M),
    )


def gspo(old, lp, A, M, p):
    nk = lp - old
    lens = np.maximum(M.sum(-1), 1)
    seq = (nk * M).sum(-1) / lens
    lr = np.minimum(np.broadcast_to(seq[:, None], lp.shape), 10.0)  # value of sg(seq) + lp - sg(lp)
    r = np.exp(lr)
    l1 = -A * r
    l2 = -A * np.clip(r, 1 - p["clip_low"], 1 + p["clip_high"])
    L = np.maximum(l1, l2)
    return dict(loss=agg(L, M, "seq-mean-token-mean"), pg_clipfrac=mmean((l2 > l1).astype(float), M), ppo_kl=mmean(-nk, M), pg_clipfrac_lower=0.0)


def sapo(old, lp, A, M, p):
    nk = np.clip(lp - old, -20, 20)
    r = np.exp(nk)
    tau = np.where(A > 0, p["tau_pos"], p["tau_neg"])
    gate = 1 / (1 + np.exp(-tau * (r - 1))) * 4 / tau
    L = -gate * A
    return dict(loss=agg(L, M, "seq-mean-token-mean"), pg_clipfrac=0.0, ppo_kl=mmean(-nk, M), pg_clipfrac_lower=0.0)


def gpg_loss(old, lp, A, M, p):
    return dict(loss=agg(-lp * A, M, p["agg"]))


def cispo(old, lp, A, M, p):
    nk = np.clip(lp - old, -20, 20)
    r = np.exp(nk)
    c = np.clip(r, 1 - p["clip_low"], 1 + p["clip_high"])
    L = -c * A * lp
    return dict(loss=agg(L, M, p["agg"]), pg_clipfrac=mmean((r != c).astype(float), M), ppo_kl=mmean(-nk, M), pg_clipfrac_lower=0.0)


def geo_mean(old, lp, A, M, p):
    nk = lp - old
    sg = np.sign(A)
    cl = np.clip(nk, -p["clip_low"], p["clip_high"])
    mn = sg * np.minimum(sg * nk, sg * cl)
    n = M.sum(-1)
    ratio = np.exp((mn * M).sum(-1) / (n + 1e-8))
    adv = (A * M).sum(-1) / (n + 1e-8)
    clipped = (nk != cl).astype(float)
    return dict(
        loss=float(np.mean(-adv * ratio)),
        pg_clipfrac=mmean(clipped * (A > 0), M),
        ppo_kl=mmean(-nk, M),
        pg_clipfrac_lower=mmean(clipped * (A < 0), M),
    )


def clip_cov(old, lp, A, M, p):
    # Inputs are chosen so that every candidate token is cut (candidates <= clip_num), which
    # makes verl's random choice deterministic.
    nk = lp - old
    r = np.exp(nk)
    l1 = -A * r
    l2 = -A * np.clip(r, 1 - p["clip_low"], 1 + p["clip_high"])
    by_origin = (l2 > l1) & (M > 0)
    cov = (A - mmean(A, M)) * (lp - mmean(lp, M))
    cov = np.where(M == 0, -np.inf, cov)
    cov = np.where(by_origin, -np.inf, cov)
    clip_num = max(int(p["clip_cov_ratio"] * M.sum()), 1)
    cand = np.argwhere((cov < p["clip_cov_ub"]) & (cov > p["clip_cov_lb"]) & (M > 0))
    assert len(cand) <= clip_num, "golden case must be deterministic"
    corr = np.ones_like(A)
    for i, j in cand:
        corr[i, j] = 0
    L = np.maximum(l1, l2) * corr
    return dict(loss=agg(L, M, p["agg"]), pg_clipfrac=mmean((corr == 0).astype(float), M), ppo_kl=mmean(-nk, M), cut=int(len(cand)))


def kl_cov(old, lp, A, M, p):
    nk = lp - old
    r = np.exp(nk)
    l1 = -A * r
    lkl = -A * r + p["ppo_kl_coef"] * np.abs(nk)
    L = l1.copy()
    valid = np.argwhere(M.reshape(-1) > 0).reshape(-1)
    a = A.reshape(-1)[valid]
    l = lp.reshape(-1)[valid]
    cov = (a - a.mean()) * (l - l.mean())
    k = max(1, int(len(cov) * p["kl_cov_ratio"]))
    top = np.argsort(-cov, kind="stable")[:k]
    flatL, flatK = L.reshape(-1), lkl.reshape(-1)
    for t in valid[top]:
        flatL[t] = flatK[t]
    return dict(loss=agg(flatL.reshape(A.shape), M, p["agg"]), ppo_kl=mmean(np.abs(nk), M))


POLICY = {"vanilla": vanilla, "gspo": gspo, "sapo": sapo, "gpg": gpg_loss, "cispo": cispo, "geo_mean": geo_mean, "clip_cov": clip_cov, "kl_cov": kl_cov}


# ---------------------------------------------------------------- value, KL, entropy
def value_loss(vp, ret, V, M, c, mode):
    vc = np.maximum(np.minimum(vp, V + c), V - c)
    l1 = (vp - ret) ** 2
    l2 = (vc - ret) ** 2
    return 0.5 * agg(np.maximum(l1, l2), M, mode), mmean((l2 > l1).astype(float), M)


def kl_forward(lp, ref, kind):
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = np.clip(ref - lp, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


def entropy(logits):
    z = logits - logits.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1, keepdims=True))
    logp = z - lse
    return -(np.exp(logp) * logp).sum(-1)


# ---------------------------------------------------------------- cases
def arr(x):
    return np.asarray(x, dtype=float).tolist()


B, T = 6, 5
# Row 2 has holes, row 4 is fully masked, the others are prefix masks.
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], float)
INDEX = [7, 7, 7, 3, 3, 9]  # a group of 3, a group of 2, a group of 1


def outcome_rewards(scores):
    R = np.zeros((B, T))
    for b, s in enumerate(scores):
        last = np.nonzero(MASK[b])[0]
        R[b, last[-1] if len(last) else T - 1] = s
    return R


out = {"masked": [], "advantage": [], "agg": [], "policy": [], "value": [], "kl": [], "entropy": [], "kl_ctrl": [], "kl_in_reward": []}

X = rng.normal(size=(B, T))
out["masked"].append(dict(name="holes_and_empty_row", values=arr(X), mask=arr(MASK), sum=msum(X, MASK), mean=mmean(X, MASK), var=mvar(X, MASK), whiten=arr(mwhiten(X, MASK)), whiten_noshift=arr(mwhiten(X, MASK, False))))

scores = rng.integers(0, 3, size=B).astype(float)
R_out = outcome_rewards(scores)
R_dense = rng.normal(size=(B, T)) * MASK
V = rng.normal(size=(B, T))
tie_scores = np.array([1.0, 1.0, 0.0, 2.0, 2.0, 0.5])
for name, R in [("outcome", R_out), ("dense", R_dense)]:
    for gamma, lam in [(1.0, 1.0), (0.9, 0.95)]:
        adv, ret = gae(R, V, MASK, gamma, lam)
        out["advantage"].append(dict(name=f"gae_{name}_{gamma}_{lam}", estimator="gae", gamma=gamma, lam=lam, norm=True, rewards=arr(R), mask=arr(MASK), values=arr(V), index=INDEX, adv=arr(adv), ret=arr(ret)))
    for gamma in [1.0, 0.9]:
        adv, ret = reinforce_pp(R, MASK, gamma)
        out["advantage"].append(dict(name=f"rfpp_{name}_{gamma}", estimator="reinforce_plus_plus", gamma=gamma, lam=1.0, norm=True, rewards=arr(R), mask=arr(MASK), index=INDEX, adv=arr(adv), ret=arr(ret)))
for norm in [True, False]:
    adv, ret = grpo(R_out, MASK, INDEX, norm)
    out["advantage"].append(dict(name=f"grpo_norm_{norm}", estimator="grpo", gamma=1.0, lam=1.0, norm=norm, rewards=arr(R_out), mask=arr(MASK), index=INDEX, adv=arr(adv), ret=arr(ret)))
    for sc, tag in [(scores, "random"), (tie_scores, "ties")]:
        R = outcome_rewards(sc)
        adv, ret = grpo_passk(R, MASK, INDEX[:5] + [7], norm)
        out["advantage"].append(dict(name=f"grpo_passk_{tag}_{norm}", estimator="grpo_passk", gamma=1.0, lam=1.0, norm=norm, rewards=arr(R), mask=arr(MASK), index=INDEX[:5] + [7], adv=arr(adv), ret=arr(ret)))
for est, fn in [("rloo", lambda R: rloo(R, MASK, INDEX)), ("rloo_vectorized", lambda R: rloo(R, MASK, INDEX, True)), ("reinforce_plus_plus_baseline", lambda R: reinforce_pp_baseline(R, MASK, INDEX)), ("opo", lambda R: opo(R, MASK, INDEX)), ("gpg", lambda R: gpg(R, MASK, INDEX))]:
    adv, ret = fn(R_out)
    out["advantage"].append(dict(name=est, estimator=est, gamma=1.0, lam=1.0, norm=True, rewards=arr(R_out), mask=arr(MASK), index=INDEX, adv=arr(adv), ret=arr(ret)))
base = rng.integers(0, 3, size=B).astype(float)
adv, ret = remax(R_dense, MASK, base)
out["advantage"].append(dict(name="remax", estimator="remax", gamma=1.0, lam=1.0, norm=True, rewards=arr(R_dense), mask=arr(MASK), index=INDEX, baselines=arr(base), adv=arr(adv), ret=arr(ret)))

Lmat = rng.normal(size=(B, T))
for mode in ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
    out["agg"].append(dict(name=mode, mode=mode, loss_mat=arr(Lmat), mask=arr(MASK), scale=None, loss=agg(Lmat, MASK, mode)))
out["agg"].append(dict(name="norm_with_scale", mode="seq-mean-token-sum-norm", loss_mat=arr(Lmat), mask=arr(MASK), scale=3.0, loss=agg(Lmat, MASK, "seq-mean-token-sum-norm", 3.0)))

old = -np.abs(rng.normal(size=(B, T))) - 0.5
# New log-probs: moderate moves plus some large ones so that clipping and the dual clip fire.
lp = old + rng.normal(scale=0.3, size=(B, T))
lp[0, 1] = old[0, 1] + 1.5
lp[1, 0] = old[1, 0] + 2.0  # ratio e^2 ≈ 7.4 > clip_ratio_c=3 with a negative advantage
A = rng.normal(size=(B, T))
A[1, 0] = -1.3
A[0, 1] = 0.8
base_p = dict(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05, clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.1)
for mode in POLICY:
    aggs = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"] if mode == "vanilla" else ["token-mean"]
    for agg_mode in aggs:
        p = dict(base_p, agg=agg_mode)
        if mode == "clip_cov":
            p = dict(p, clip_cov_lb=0.5, clip_cov_ratio=0.3)
        res = POLICY[mode](old, lp, A, MASK, p)
        out["policy"].append(dict(name=f"{mode}_{agg_mode}", mode=mode, params=p, old=arr(old), logp=arr(lp), adv=arr(A), mask=arr(MASK), **res))

vp = rng.normal(size=(B, T))
ret_v = rng.normal(size=(B, T))
for mode in ["token-mean", "seq-mean-token-mean"]:
    loss, cf = value_loss(vp, ret_v, V, MASK, 0.5, mode)
    out["value"].append(dict(name=mode, mode=mode, vpreds=arr(vp), returns=arr(ret_v), values=arr(V), mask=arr(MASK), cliprange=0.5, loss=loss, vf_clipfrac=cf))

ref = old + rng.normal(scale=0.5, size=(B, T))
ref[2, 2] = old[2, 2] + 30.0  # hits the ±20 clamp of k3
for kind in ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]:
    out["kl"].append(dict(kind=kind, logp=arr(old), ref=arr(ref), value=arr(kl_forward(old, ref, kind))))

logits = rng.normal(scale=3.0, size=(7, 11))
out["entropy"].append(dict(logits=arr(logits), entropy=arr(entropy(logits))))

for typ in ["fixed", "adaptive"]:
    v, vals = 0.05, []
    updates = [[0.3, 64], [0.05, 64], [0.1, 32], [0.0, 128]]
    for kl, n in updates:
        if typ == "adaptive":
            v *= 1 + np.clip(kl / 0.1 - 1, -0.2, 0.2) * n / 1000.0
        vals.append(v)
    out["kl_ctrl"].append(dict(type=typ, kl_coef=0.05, target_kl=0.1, horizon=1000.0, updates=updates, values=vals))

scores_tok = outcome_rewards(scores)
for kind in ["kl", "low_var_kl"]:
    kld = kl_forward(old, ref, kind) * MASK
    beta = 0.05
    rewards = scores_tok - beta * kld
    current = float(np.mean(mmean_rows(kld, MASK)))
    out["kl_in_reward"].append(dict(kind=kind, scores=arr(scores_tok), old=arr(old), ref=arr(ref), mask=arr(MASK), beta=beta, rewards=arr(rewards), current_kl=current, beta_after_adaptive=beta * (1 + np.clip(current / 0.1 - 1, -0.2, 0.2) * B / 1000.0)))

OUT.parent.mkdir(parents=True, exist_ok=True)
OUT.write_text(json.dumps(out, indent=1))
print(f"wrote {OUT} ({sum(len(v) for v in out.values())} cases)")
