"""Same seeds on two revisions of ``hi_sparse``: decode outputs, selections and counters.

    PYTHONPATH=/tmp/old .venv/bin/python benchmarks/compare_revisions.py --out old.json
    .venv/bin/python benchmarks/compare_revisions.py --out new.json --against old.json

Not a benchmark: a check that a change meant to keep behaviour (the performance work of issue 21)
keeps it. Through the public engine API only (it runs on any revision): B = 3 sequences, 2 layers,
top_k 48, 8-token blocks, bound_group 2, audits every 4 steps, a requested recalibration at
step 8 (probes fitted, then anchors pinned by them), host_kv_bits None / 4 / auto, equal lengths
(200) and mixed ones (200, 150, 23), 40 decode steps. ``--against`` prints, per case, the largest
output difference and whether the selections and counters are equal.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

COUNTERS = ("hot_buffer_lookups", "hot_buffer_hits", "prefetch_issued", "prefetch_used", "kv_tokens_used",
            "kv_tokens_loaded", "swap_in_bytes", "backup_bytes", "anchor_lookups", "anchor_hits")


def run(bits, lengths: tuple[int, ...]) -> tuple[list, list, dict]:
    import hi_sparse as hs

    torch.manual_seed(0)
    H, Hq, D, L = 2, 4, 16, 2
    cfg = hs.HiSparseConfig(max_seq_len=1024, cache_block_size=8, window_size=16, top_k=48, global_tokens=4,
                            host_kv_bits=bits, bound_group=2, telemetry=False, audit_every=4,
                            recalibrate_every=64, device_buffer_tokens=96)
    eng = hs.HiSparseEngine(cfg, num_layers=L, num_q_heads=Hq, num_kv_heads=H, head_dim=D)
    ids = eng.add_sequences(len(lengths))
    for sid, n in zip(ids, lengths):
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, [sid], torch.randn(1, H, n, D), torch.randn(1, H, n, D))
        eng.end_step()
    outs = []
    for step in range(40):
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, torch.randn(len(ids), H, 1, D), torch.randn(len(ids), H, 1, D))
            outs.append(eng.attend(layer, ids, torch.randn(len(ids), Hq, 1, D)).tolist())
        eng.end_step()
        if step == 8:
            eng.request_recalibration()
    st = eng.stats
    sels = [eng.selection(layer, s).tolist() for layer in range(L) for s in ids]
    return outs, sels, {k: getattr(st, k) for k in COUNTERS}


def _flat(x):
    if isinstance(x, list):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--against", default=None, help="another revision's --out to compare with")
    args = ap.parse_args()
    res = {f"{bits}-{lengths}": run(bits, lengths)
           for bits in (None, 4, "auto") for lengths in ((200, 200, 200), (200, 150, 23))}
    with open(args.out, "w") as f:
        json.dump(res, f)
    if args.against:
        with open(args.against) as f:
            other = json.load(f)
        for case, (outs, sels, counts) in res.items():
            o_outs, o_sels, o_counts = other[case]
            diff = max(abs(a - b) for a, b in zip(_flat(outs), _flat(o_outs)))
            same = {k: v for k, v in counts.items() if o_counts[k] != v}
            print(f"{case}: max |output difference| {diff:.2e}, selections equal {sels == o_sels}, "
                  f"counters equal {not same}" + (f" (differ: {same} vs {o_counts})" if same else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
