"""Kernels for HiSparse: per op, a plain-PyTorch reference, a Triton kernel and a launcher."""
