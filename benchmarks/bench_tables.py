"""Host time of refreshing a batch's block tables on the step where every sequence gains a block
(issue 21): decode.Batch.refresh_tables (only the appended columns) against rebuilding the whole
table from the page lists, as it did before, for B sequences of N tokens in 64-token blocks.

    python benchmarks/bench_tables.py --batch 24 --tokens 131072
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_sparse.block_pool import BlockPool
from hi_sparse.decode import Batch
from hi_sparse.page_table import PageTable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    bs, B = 64, args.batch
    blocks = args.tokens // bs
    pool = BlockPool(B * (blocks + args.repeat + 1), grace_s=1.0)
    pt = PageTable(pool, bs)
    for s in range(B):
        pt.add_sequence(s)
        pt.extend(s, args.tokens, pool.get_new_blocks(blocks))
    batch = Batch.__new__(Batch)                 # the table and its bookkeeping only
    batch.seq_ids, batch._uploaded = tuple(range(B)), None
    batch.tables = torch.full((B, blocks + args.repeat + 1), -1, dtype=torch.int64)
    batch.refresh_tables(pt)
    inc, whole = [], []
    for _ in range(args.repeat):
        for s in range(B):
            pt.extend(s, bs, pool.get_new_blocks(1))
        t = time.perf_counter()
        batch.refresh_tables(pt)
        inc.append(time.perf_counter() - t)
        t = time.perf_counter()
        ids = [pt.block_ids(i) for i in batch.seq_ids]
        w = max(len(x) for x in ids)
        batch.tables[:, :w].copy_(torch.tensor([x + [-1] * (w - len(x)) for x in ids], dtype=torch.int64))
        whole.append(time.perf_counter() - t)
    print(f"{B} sequences of {blocks} blocks, one block appended to each: the appended column "
          f"{1e3 * statistics.median(inc):.3f} ms, the whole table {1e3 * statistics.median(whole):.2f} ms "
          f"(median of {args.repeat})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
