"""A decode step's block ranking on CUDA: the fused mask + rank kernel against today's launches.

selection.select ranks each row's candidate blocks (rows = batch x KV heads, NB blocks a row):
``candidate_scores`` (the masked fp32 scores, one launch) then ``s.topk(take)`` (torch: two
kernels), against ``ranked_candidates`` (kernels/select.py: both in one launch, one program a
row: chunks of packed score-and-index keys sorted, then halved by bitonic merges). Then
two_level_candidates' ranking of the super-blocks, ``top_blocks``: torch.topk against the same
kernel unmasked (``row_topk``). Each variant is checked to rank like the other, then timed in a
CUDA graph of --reps calls (the decode step runs in one), so the times are of the kernels, not
their launches; microseconds per call.

On an H200 (torch 2.11, Triton 3.6), take 48: 8 rows 13.8 -> 3.0 us at NB 512, 21.6 -> 9.1 at
2048, 29.0 -> 17.1 at 4096; 192 rows 18.5 -> 4.5, 32.1 -> 16.3, 51.9 -> 31.1; top_blocks (n 4,
rows of 32-128) 4.6-6.9 -> 1.4-1.8 us.

    python benchmarks/bench_rank.py [--rows 8,192] [--nb 512,2048] [--take 48]
                                    [--super-rows 32,128] [--n-super 4] [--reps 200]
"""
from __future__ import annotations

import argparse
import sys

import torch
from graph_timing import graph_us as timed


def rank_candidates(args, dev: torch.device) -> None:
    from hi_sparse.kernels.select import candidate_scores, ranked_candidates

    bs, window = 64, 64
    print(f"\nselect's ranking: take {args.take}, {bs}-token blocks, window {window}")
    print("| rows | NB | candidate_scores + topk us | ranked_candidates us | same ranking |\n|---:|---:|---:|---:|---|")
    for rows in [int(x) for x in args.rows.split(",")]:
        for nb in [int(x) for x in args.nb.split(",")]:
            g = torch.Generator().manual_seed(rows * nb)
            n = torch.randint(nb * bs // 2, nb * bs + 1, (rows, 1), generator=g)   # NaN past a row's tokens
            first = torch.randint(0, 4 * bs, (rows, 1), generator=g)
            scores = torch.randn(rows, nb, generator=g)
            scores[torch.arange(nb)[None] * bs >= n] = float("nan")
            scores, n, first = scores.to(dev), n.to(dev), first.to(dev)

            def two_steps():
                s = candidate_scores(scores, n, first, window, bs)
                return s, s.topk(args.take, dim=1).indices

            def fused():
                return ranked_candidates(scores, n, first, window, bs, args.take)

            (s0, top0), (s1, top1) = two_steps(), fused()
            same = torch.equal(s0, s1) and torch.equal(s0.gather(1, top0), s1.gather(1, top1))
            print(f"| {rows} | {nb} | {timed(two_steps, args.reps):.1f} | {timed(fused, args.reps):.1f} | {same} |",
                  flush=True)


def rank_super_blocks(args, dev: torch.device) -> None:
    from hi_sparse.kernels import top_blocks

    n = args.n_super
    print(f"\ntop_blocks: the {n} best super-blocks of a row")
    print("| rows | row length | torch.topk us | top_blocks (kernel) us | same set |\n|---:|---:|---:|---:|---|")
    for rows in [int(x) for x in args.rows.split(",")]:
        for length in [int(x) for x in args.super_rows.split(",")]:
            g = torch.Generator().manual_seed(rows + length)
            scores = torch.randn(rows, length, generator=g).to(dev)

            def topk():
                return scores.topk(n, dim=-1, sorted=False).indices

            def kernel():
                return top_blocks(scores, n)

            same = torch.equal(topk().sort(-1).values, kernel().sort(-1).values)
            print(f"| {rows} | {length} | {timed(topk, args.reps):.1f} | {timed(kernel, args.reps):.1f} | {same} |",
                  flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,192", help="rows (batch x KV heads)")
    ap.add_argument("--nb", default="512,2048", help="blocks per row (512: 32K tokens, 2048: 128K)")
    ap.add_argument("--take", type=int, default=48)
    ap.add_argument("--super-rows", default="32,128", help="super-blocks per row for top_blocks")
    ap.add_argument("--n-super", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_rank: no CUDA device here (torch.cuda.is_available() is False): it times CUDA kernels in "
              "CUDA graphs; run it on a GPU machine")
        return 0
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    rank_candidates(args, dev)
    rank_super_blocks(args, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
