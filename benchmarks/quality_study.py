"""Where HiSparse loses quality on a real model, measured offline from one captured forward.

    python benchmarks/quality_study.py capture --context 6144 --out /tmp/kv6k.pt
    python benchmarks/quality_study.py quant /tmp/kv6k.pt           # K/V error per layer and head
    python benchmarks/quality_study.py recall /tmp/kv6k.pt          # attention mass the selection keeps

capture: one exact forward of the model over ``context + continuation`` tokens of the text,
keeping each layer's query, key and value (after RoPE, as the KV cache holds them). The other
commands read that file: no model, seconds instead of the runtime's minutes per configuration.
"""
from __future__ import annotations

import argparse
import time

import torch


def capture(args: argparse.Namespace) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hi_sparse.real_model import load_model, load_text, token_ids

    lm = load_model()
    ids = torch.tensor([token_ids(lm.tokenizer, load_text(args.text), args.context + args.continuation)])
    kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def keep(module, query, key, value, attention_mask, **kw):
        kept[module.layer_idx] = (query[0].clone(), key[0].clone(), value[0].clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("capture", keep)
    lm.model.set_attn_implementation("capture")
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = lm.model(ids, use_cache=False, logits_to_keep=args.continuation + 1).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, args.context:], reduction="none")
    L = len(kept)
    torch.save({"ids": ids, "context": args.context, "text": args.text,
                "q": [kept[i][0] for i in range(L)], "k": [kept[i][1] for i in range(L)],
                "v": [kept[i][2] for i in range(L)], "dense_nll": nll}, args.out)
    print(f"captured {L} layers over {ids.shape[1]} tokens in {time.perf_counter() - t0:.0f} s; "
          f"dense perplexity of the continuation {nll.mean().exp():.3f} -> {args.out}")


def fake_quant(x: torch.Tensor, bits: int, axis: str) -> torch.Tensor:
    """Quantize-dequantize units x (N, T, D): one scale and zero per unit ("block"), per channel
    over the unit's tokens ("channel") or per token over its channels ("token")."""
    dims = {"block": (1, 2), "channel": (1,), "token": (2,)}[axis]
    lo, hi = x.amin(dims, keepdim=True), x.amax(dims, keepdim=True)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor((x - lo) / safe + 0.5).clamp(0, levels)
    return q * scale + lo


def units(x: torch.Tensor, bs: int) -> torch.Tensor:
    """(H, L, D) -> (H, L // bs, bs, D): the full blocks of each head."""
    H, L, D = x.shape
    nb = L // bs
    return x[:, : nb * bs].reshape(H, nb, bs, D)


def rel_err(x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
    return (x - xh).flatten(-2).norm(dim=-1) / x.flatten(-2).norm(dim=-1).clamp_min(1e-12)


def quant(args: argparse.Namespace) -> None:
    """Per layer: the relative error of 64-token units under each layout (mean and 95th
    percentile over heads and blocks), and what it does to attention: the continuation's queries
    over the context quantized in full blocks (the rest exact), total variation of the attention
    weights and relative error of the attention output, against exact."""
    cap = torch.load(args.file)
    ctx, bs, bits = cap["context"], args.block_size, args.bits
    L = len(cap["k"])
    schemes = [("block", "block"), ("channel", "token"), ("channel", "channel"), ("token", "token")]
    print(f"{bits}-bit, {bs}-token units; rel err mean/p95 per layout (K | V); attention TV and output error "
          f"for K/V layouts {schemes}")
    totals: dict[str, list[float]] = {}
    for i in range(L):
        q, k, v = cap["q"][i].float(), cap["k"][i].float(), cap["v"][i].float()
        Hq, H, D = q.shape[0], k.shape[0], k.shape[-1]
        G = Hq // H
        nfull = ctx // bs
        row = [f"L{i:02d}"]
        ku, vu = units(k[:, :ctx], bs), units(v[:, :ctx], bs)
        errs = {}
        for axis in ("block", "channel", "token"):
            for name, u in (("k", ku), ("v", vu)):
                e = rel_err(u, fake_quant(u.reshape(-1, bs, D), bits, axis).view_as(u))
                errs[(name, axis)] = e
        for name in ("k", "v"):
            row.append(" ".join(f"{errs[(name, a)].mean():.3f}/{errs[(name, a)].quantile(0.95):.3f}"
                                for a in ("block", "channel", "token")))
        # attention of the continuation's queries
        qc = q[:, ctx:]                                           # (Hq, C, D)
        C = qc.shape[1]
        n = k.shape[1]
        mask = torch.arange(n)[None, :] <= (ctx + torch.arange(C))[:, None]

        def attend(kk, vv):
            kk = kk.repeat_interleave(G, 0)
            vv = vv.repeat_interleave(G, 0)
            s = (qc @ kk.transpose(1, 2)) * D ** -0.5
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
            return p, p @ vv
        p0, o0 = attend(k, v)
        for ka, va in schemes:
            kq, vq = k.clone(), v.clone()
            kq[:, : nfull * bs] = fake_quant(ku.reshape(-1, bs, D), bits, ka).view(H, -1, D)
            vq[:, : nfull * bs] = fake_quant(vu.reshape(-1, bs, D), bits, va).view(H, -1, D)
            p1, o1 = attend(kq, vq)
            tv = 0.5 * (p1 - p0).abs().sum(-1).mean().item()
            oe = ((o1 - o0).norm(dim=-1) / o0.norm(dim=-1).clamp_min(1e-12)).mean().item()
            totals.setdefault(f"{ka}/{va} tv", []).append(tv)
            totals.setdefault(f"{ka}/{va} out", []).append(oe)
            row.append(f"{ka[0]}{va[0]} tv {tv:.3f} out {oe:.3f}")
        print("  ".join(row), flush=True)
    print("mean over layers: " + ", ".join(f"{k} {sum(v) / len(v):.4f}" for k, v in totals.items()))


def exact_probs(q: torch.Tensor, k: torch.Tensor, ctx: int) -> torch.Tensor:
    """Attention weights of the continuation's queries (positions ctx..n-1) over every token they
    see: q (Hq, n, D), k (Hkv, n, D) -> (Hq, C, n) fp32."""
    Hq, n, D = q.shape
    G = Hq // k.shape[0]
    C = n - ctx
    s = (q[:, ctx:].float() @ k.float().repeat_interleave(G, 0).transpose(1, 2)) * D ** -0.5
    mask = torch.arange(n)[None, :] <= (ctx + torch.arange(C))[:, None]
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1)


def page_scores(q: torch.Tensor, k: torch.Tensor, ctx: int, ps: int, how: str,
                probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per KV head, continuation query and page of ps tokens: (Hkv, C, NP, G) per query head
    scores. how: "quest" (upper bound from page min/max keys), "mean" (q . mean key), "oracle"
    (the page's exact attention mass, from probs (Hq, C, n))."""
    Hq, n, D = q.shape
    H = k.shape[0]
    G = Hq // H
    npg = -(-n // ps)
    if how == "oracle":
        pm = torch.nn.functional.pad(probs, (0, npg * ps - n)).view(Hq, -1, npg, ps).sum(-1)   # (Hq, C, NP)
        return pm.view(H, G, -1, npg).permute(0, 2, 3, 1)
    kp = torch.nn.functional.pad(k.float(), (0, 0, 0, npg * ps - n), value=float("nan")).view(H, npg, ps, D)
    qc = q[:, ctx:].float().view(H, G, -1, D)                                     # (H, G, C, D)
    if how == "mean":
        s = qc @ kp.nanmean(2).transpose(1, 2)[:, None]
    else:
        kmin = torch.where(kp.isnan(), float("inf"), kp).amin(2)
        kmax = torch.where(kp.isnan(), float("-inf"), kp).amax(2)
        s = qc.clamp(min=0) @ kmax.transpose(1, 2)[:, None] + qc.clamp(max=0) @ kmin.transpose(1, 2)[:, None]
    return s.permute(0, 2, 3, 1)                                                 # (H, C, NP, G)


def rank_pages(s: torch.Tensor, combine: str) -> torch.Tensor:
    """(H, C, NP, G) per-head scores -> (H, C, NP) page order, best first. combine: "max" over the
    group (the runtime), "sum", or "perhead": the pages by their best rank in any query head (a
    round robin over the heads' own rankings; ties by the max)."""
    if combine == "max":
        key = s.amax(-1)
    elif combine == "sum":
        key = s.sum(-1)
    else:
        r = s.argsort(2, descending=True).argsort(2).float()                      # rank per head
        key = -(r.amin(-1)) + 1e-6 * torch.tanh(s.amax(-1) / 100)
    return key.nan_to_num(float("-inf")).argsort(-1, descending=True)


def keep_mask(q: torch.Tensor, k: torch.Tensor, ctx: int, top_k: int, window: int, ps: int, sinks: int,
              how: str, combine: str, probs: torch.Tensor | None = None) -> torch.Tensor:
    """(Hkv, C, n) bool: the tokens each KV head of each continuation query attends to: the window
    (its last ``window`` tokens), the first ``sinks`` tokens, then ranked pages' tokens before the
    window until ``top_k``."""
    H, n = k.shape[0], k.shape[1]
    C = n - ctx
    t = ctx + torch.arange(C)                                                    # query positions
    w0 = (t + 1 - window).clamp(min=0)                                           # window start
    pos = torch.arange(n)
    keep = (pos[None] >= w0[:, None]) & (pos[None] <= t[:, None])               # (C, n)
    keep |= (pos[None] < sinks) & (pos[None] <= t[:, None])
    keep = keep[None].expand(H, C, n).clone()
    budget = (top_k - keep.sum(-1)).clamp(min=0)                                 # (H, C)
    order = rank_pages(page_scores(q, k, ctx, ps, how, probs), combine)         # (H, C, NP)
    tok = (order[..., None] * ps + torch.arange(ps)).flatten(2)                  # (H, C, NP*ps)
    ok = (tok < w0[None, :, None]) & (tok >= sinks)
    chosen = ok & (ok.long().cumsum(-1) <= budget[..., None])
    picked = torch.zeros(H, C, n + 1, dtype=torch.bool).scatter_(2, torch.where(chosen, tok, n), True)
    return keep | picked[..., :n]


VARIANTS = {   # name: (page size or 0 for the block size, sinks, score, combine)
    "runtime (quest max, 64)": (0, 0, "quest", "max"),
    "+ 4 sinks": (0, 4, "quest", "max"),
    "+ 64 sinks": (0, 64, "quest", "max"),
    "per-head ranks, 4 sinks": (0, 4, "quest", "perhead"),
    "sum ranks, 4 sinks": (0, 4, "quest", "sum"),
    "mean key, 4 sinks": (0, 4, "mean", "max"),
    "pages 16, 4 sinks": (16, 4, "quest", "max"),
    "pages 16 per-head, 4 sinks": (16, 4, "quest", "perhead"),
    "pages 32 per-head, 4 sinks": (32, 4, "quest", "perhead"),
    "oracle blocks, 4 sinks": (0, 4, "oracle", "sum"),
    "oracle pages 16, 4 sinks": (16, 4, "oracle", "sum"),
}


def recall(args: argparse.Namespace) -> None:
    """Per layer: attention mass the selection keeps (mean over query heads and continuation
    queries, and its 5th percentile), for each selection variant, plus where dense attention goes
    (token 0, the window)."""
    cap = torch.load(args.file)
    ctx, bs = cap["context"], args.block_size
    names = [v for v in VARIANTS if not args.variants or any(x in v for x in args.variants.split(","))]
    print(f"context {ctx}, top_k {args.top_k}, window {args.window}, blocks {bs}: kept mass mean (p5) per layer")
    print("layer  tok0  window  " + "  ".join(f"{n[:26]:>26}" for n in names))
    sums = {n: [] for n in names}
    for i in range(len(cap["k"])):
        q, k = cap["q"][i], cap["k"][i]
        p = exact_probs(q, k, ctx)                                               # (Hq, C, n)
        G = q.shape[0] // k.shape[0]
        C, n = p.shape[1], p.shape[2]
        t = ctx + torch.arange(C)
        inwin = torch.arange(n)[None] > (t - args.window)[:, None]
        cols = [f"{p[..., 0].mean():.2f}", f"{(p * inwin).sum(-1).mean():.2f}"]
        for name in names:
            ps, sinks, how, combine = VARIANTS[name]
            keep = keep_mask(q, k, ctx, args.top_k, args.window, ps or bs, sinks, how, combine, p)
            kept = (p * keep.repeat_interleave(G, 0)).sum(-1)                    # (Hq, C)
            sums[name].append(kept.mean().item())
            cols.append(f"{kept.mean():.3f} ({kept.flatten().quantile(0.05):.2f})".rjust(26))
        print(f"L{i:02d}   {cols[0]}  {cols[1]}   " + "  ".join(cols[2:]), flush=True)
    print("mean         " + "  ".join(f"{sum(v) / len(v):26.3f}" for v in sums.values()))


def emulate(args: argparse.Namespace) -> None:
    """Teacher-forced perplexity of the continuation with the continuation's attention emulated in
    one parallel forward: each query attends to the tokens keep_mask selects for it, over keys and
    values quantized (fake_quant) in the full blocks before its own block, as the runtime's host
    pool holds them; the context's own queries attend exactly (the runtime's prefill). No anchors,
    probe or hot buffer: a what-if tool, the runtime measures the real thing (hi_sparse.eval)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hi_sparse.real_model import load_model, load_text, token_ids

    lm = load_model()
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = args.context
    ids = torch.tensor([token_ids(lm.tokenizer, load_text(args.text), ctx + args.continuation)])
    bs = args.block_size
    cfg: dict = {}

    def attend(module, query, key, value, attention_mask, **kw):
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)   # (1, n, Hq, D)
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        Hq, n, D = q.shape
        H = k.shape[0]
        G = Hq // H
        C = n - ctx
        t = ctx + torch.arange(C)
        pos = torch.arange(n)
        visible = (pos[None] <= t[:, None])[None].expand(H, C, n)
        if cfg.get("top_k"):
            keep = keep_mask(q, k, ctx, cfg["top_k_of"](module.layer_idx), cfg["window"], cfg["page"], cfg["sinks"],
                             cfg["how"], cfg["combine"])
        else:
            keep = visible
        s = (q[:, ctx:] @ k.repeat_interleave(G, 0).transpose(1, 2)) * D ** -0.5        # (Hq, C, n)
        vv = v.repeat_interleave(G, 0)
        quantized = None
        if cfg.get("kbits") or cfg.get("vbits"):
            nfull = n // bs
            kh, vh = k.clone(), v.clone()
            if cfg.get("kbits"):
                kq = fake_quant(units(k, bs).reshape(-1, bs, D), cfg["kbits"], cfg["kaxis"])
                kh[:, : nfull * bs] = kq.view(H, -1, D)
            if cfg.get("vbits"):
                vq = fake_quant(units(v, bs).reshape(-1, bs, D), cfg["vbits"], cfg["vaxis"])
                vh[:, : nfull * bs] = vq.view(H, -1, D)
            quantized = (pos[None] // bs < t[:, None] // bs)                           # (C, n)
            sq = (q[:, ctx:] @ kh.repeat_interleave(G, 0).transpose(1, 2)) * D ** -0.5
            s = torch.where(quantized, sq, s)
        s = s.masked_fill(~keep.repeat_interleave(G, 0), float("-inf"))
        p = torch.softmax(s, -1)
        if quantized is not None:
            o = (p * quantized) @ vh.repeat_interleave(G, 0) + (p * ~quantized) @ vv
        else:
            o = p @ vv
        out = out.clone()
        out[0, ctx:] = o.transpose(0, 1).to(out.dtype)
        return out, None

    AttentionInterface.register("emulate", attend)
    lm.model.set_attn_implementation("emulate")
    for spec in args.configs:
        cfg.clear()
        cfg.update(window=args.window, page=bs, sinks=0, how="quest", combine="max")
        for item in spec.split(","):
            key, _, val = item.partition("=")
            if key in ("top_k", "window", "page", "sinks", "kbits", "vbits"):
                cfg[key] = int(val)
            elif key in ("how", "combine", "kaxis", "vaxis"):
                cfg[key] = val
            elif key == "layer_top_k":       # e.g. layer_top_k=0-2:2048 (a layer range's own budget)
                rng, _, budget = val.partition(":")
                lo, _, hi = rng.partition("-")
                cfg.setdefault("per_layer", []).append((int(lo), int(hi or lo), int(budget)))
            elif key != "dense":
                raise SystemExit(f"unknown option {key!r} in {spec!r}")
        per_layer = cfg.get("per_layer", [])
        cfg["top_k_of"] = lambda i: next((b for lo, hi, b in per_layer if lo <= i <= hi), cfg["top_k"])
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = lm.model(ids, use_cache=False, logits_to_keep=args.continuation + 1).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, ctx:])
        print(f"{ctx} + {args.continuation}  {spec:<70} perplexity {nll.exp():.3f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--context", type=int, default=6144)
    c.add_argument("--continuation", type=int, default=512)
    c.add_argument("--text", default="licenses")
    c.add_argument("--out", required=True)
    c = sub.add_parser("quant")
    c.add_argument("file")
    c.add_argument("--bits", type=int, default=4)
    c.add_argument("--block-size", type=int, default=64)
    c = sub.add_parser("recall")
    c.add_argument("file")
    c.add_argument("--top-k", type=int, default=512)
    c.add_argument("--window", type=int, default=256)
    c.add_argument("--block-size", type=int, default=64)
    c.add_argument("--variants", default="", help="comma list of substrings of variant names")
    c = sub.add_parser("emulate")
    c.add_argument("configs", nargs="+", help="comma lists of key=value: top_k, window, page, sinks, how, "
                   "combine, kbits, kaxis, vbits, vaxis, layer_top_k=LO-HI:BUDGET; 'dense' for none")
    c.add_argument("--context", type=int, default=2048)
    c.add_argument("--continuation", type=int, default=512)
    c.add_argument("--text", default="licenses")
    c.add_argument("--window", type=int, default=256)
    c.add_argument("--block-size", type=int, default=64)
    c.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    {"capture": capture, "quant": quant, "recall": recall, "emulate": emulate}[args.cmd](args)


if __name__ == "__main__":
    main()
