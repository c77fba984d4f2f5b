"""Launch the quantize kernels a few times each, for a profiler (ncu) to compare them (issue 6).

    ncu -k regex:quantize_fused --section SpeedOfLight ... python benchmarks/profile_quant.py

Blocks of 64 x 128 bf16 (the runtime's host-pool unit), 16,384 of them (268 MB); the fused
register-tile kernel at 4, 5, 6 and 8 bits and the split path at 8 bits.
"""
import torch

from hi_sparse.kernels import _quant_triton as q

x = torch.randn(16384, 64, 128, device="cuda", dtype=torch.bfloat16)
for bits in (4, 5, 6, 8):
    for _ in range(2):
        q.quantize(x, bits, method="fused")
for _ in range(2):
    q.quantize(x, 8, method="split")
torch.cuda.synchronize()
print("done")
