"""Would a refit from the fitted probe need fewer iterations? An offline study on SmolLM2's real fits.

    .venv/bin/python benchmarks/refit_study.py capture /tmp/fits.pt     # ~3.5 min on 2 cores
    .venv/bin/python benchmarks/refit_study.py compare /tmp/fits.pt
    .venv/bin/python benchmarks/refit_study.py time /tmp/fits.pt       # the fit alone, 3 runs

capture: SmolLM2-135M-Instruct reads 1,024 tokens of the license texts, then 96 more with a
recalibration requested every 24, then a 384-token chunk of the Python reference and 48 more
(requested every 24: a topic shift), keeping every fit's training sets and the probes' parameters
before it. compare: each refit again from the fitted probes (the runtime's warm start) for 10-100
iterations at three learning rates, and from the unfitted probes for 100, scored on its own
training set and on the next fit's (the keys the probe meets until then): the weighted
cross-entropy the fit minimises, and rec@16, of each KV head's 16 heaviest tokens the share among
its 16 highest-scored. time: one fit of 100 iterations on a recalibration's training sets (all
30 probes at once), as the runtime runs it on a CPU (probe.small_ops_on_cpu), with denormals
flushed and kept.
"""
from __future__ import annotations

import argparse

import torch

OPTIONS = dict(max_seq_len=8192, block_size=32, window_size=64, global_tokens=16, top_k=256,
               recalibrate_every=1 << 20, recalibrate_topk=16, audit_every=0, drift_floor=0.0, telemetry=False)


def capture(out: str) -> None:
    import hi_sparse.recalibration as rc
    from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
    from hi_sparse.integration import binding_of, enable_hisparse_kv_cache
    from hi_sparse.real_model import load_model, load_text, token_ids

    fits, fit = [], rc.fit_iterations

    def kept(probes, data, *a, **kw):
        before = [torch.stack([p.fc1.weight.T for p in probes]), torch.stack([p.fc1.bias for p in probes]),
                  torch.stack([p.fc2.weight[0] for p in probes]), torch.stack([p.fc2.bias[0] for p in probes])]
        fits.append({"before": [t.clone() for t in before], "fitted": [p.fitted for p in probes],
                     "data": [(x.clone(), y.clone()) for x, y in data]})
        return fit(probes, data, *a, **kw)
    rc.fit_iterations = kept
    rc.FIT_SLICE = 1 << 62               # every layer's probe in one fit: one entry a recalibration
    lm = load_model()
    lic = token_ids(lm.tokenizer, load_text("licenses"), 1024 + 96)
    py = token_ids(lm.tokenizer, load_text("python-reference"), 384 + 48)
    model = enable_hisparse_kv_cache(lm.model, **OPTIONS)
    engine, name = binding_of(model).engine, installed_cache_kwarg()
    with torch.no_grad():
        state = model(torch.tensor([lic[:1024]]), use_cache=True, logits_to_keep=1)
        for chunk, tokens in ((None, lic[1024:]), (py[:384], py[384:])):
            if chunk is not None:
                state = model(torch.tensor([chunk]), use_cache=True, logits_to_keep=1, **{name: output_cache(state)})
            for j, t in enumerate(tokens):
                state = model(torch.tensor([[t]]), use_cache=True, **{name: output_cache(state)})
                if (j + 1) % 24 == 0:
                    engine.request_recalibration()
    torch.save(fits, out)
    print(f"{len(fits)} fits -> {out}")


def scores(params: list[torch.Tensor], data: list, heads: int = 3, k: int = 16) -> tuple[float, float]:
    """(weighted cross-entropy, rec@k), means over the layers."""
    from hi_sparse.probe import row_weights

    w1, c1, w2, c2 = params
    loss = rec = 0.0
    for i, (x, y) in enumerate(data):
        z = torch.nn.functional.gelu(x.float() @ w1[i] + c1[i]) @ w2[i] + c2[i]
        y = y.float().clamp(0, 1)
        w = row_weights(y)
        loss += float((torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none") * w).mean())
        true, picked = y.view(heads, -1).topk(k, 1).indices, z.view(heads, -1).topk(k, 1).indices
        rec += float((true[:, :, None] == picked[:, None, :]).any(2).float().mean())
    return loss / len(data), rec / len(data)


def compare(path: str) -> None:
    from hi_sparse.probe import ImportanceProbe, fit_params, small_ops_on_cpu

    fits = torch.load(path)

    def probes(params):
        out = []
        for w1, c1, w2, c2 in zip(*params):
            p = ImportanceProbe(w1.shape[0])
            with torch.no_grad():
                for dst, src in ((p.fc1.weight, w1.T), (p.fc1.bias, c1), (p.fc2.weight[0], w2), (p.fc2.bias, c2)):
                    dst.copy_(src)
            out.append(p)
        return out
    runs = [("cold", 100, 0.05)] + [("warm", n, lr) for n in (100, 50, 30, 20, 10) for lr in (0.05, 0.02, 0.01)]
    for r, f in enumerate(fits):
        if not all(f["fitted"]):
            continue
        nxt = fits[r + 1]["data"] if r + 1 < len(fits) else None
        print(f"fit {r}")
        for start, n, lr in runs:
            with small_ops_on_cpu(torch.device("cpu")):
                params, _ = fit_params(probes(fits[0]["before"] if start == "cold" else f["before"]), f["data"], n, lr)
            own, later = scores(params, f["data"]), scores(params, nxt) if nxt else (float("nan"),) * 2
            print(f"  {start} {n:3d} iterations, lr {lr:.2f}: own loss {own[0]:.3f} rec@16 {own[1]:.3f}; "
                  f"next fit's loss {later[0]:.3f} rec@16 {later[1]:.3f}")


def time_fit(path: str) -> None:
    import time

    import hi_sparse.probe as probe

    data = torch.load(path)[2]["data"]
    probes = [probe.ImportanceProbe(data[0][0].shape[1]) for _ in data]
    for _ in range(3):
        for flush in (True, False):
            probe.FLUSH_DENORMALS = flush
            with probe.small_ops_on_cpu(torch.device("cpu")):
                t0 = time.perf_counter()
                probe.fit_params(probes, data)
                took = time.perf_counter() - t0
            print(f"a fit of {len(data)} probes, {len(data[0][1])} rows each, denormals "
                  f"{'flushed' if flush else 'kept   '}: {took:.2f} s", flush=True)
    probe.FLUSH_DENORMALS = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["capture", "compare", "time"])
    ap.add_argument("path")
    args = ap.parse_args()
    {"capture": capture, "compare": compare, "time": time_fit}[args.command](args.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
