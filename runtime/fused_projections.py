"""Each decoder layer's q, k and v projections as one GEMM, and its MLP's gate and up projections as
one (``fused_projections``).

A transformers Llama-family layer runs seven weight GEMMs per token: q, k, v, o, gate, up, down.
At decode the batch is a few rows, so each GEMM reads its weight once and its time is the bytes
plus a fixed cost per launch; k and v (1024 x 4096 in Llama-3-8B) are so small that cuBLAS splits
them over K and adds a reduction kernel each. On the H200 the 1 x 128K step spent ~4.6 ms in GEMMs
against the 3.4 ms its weight bytes take at full HBM bandwidth (docs/BENCHMARKS.md). Reading
q, k and v as one (6144 x 4096) weight and gate and up as one (28672 x 4096) gives five GEMMs a
layer instead of seven, and larger ones, as serving engines do (bench_projections.py on the H200:
q/k/v 26.1 -> 15.1 us a layer, gate/up 60.6 -> 54.9; the 1 x 128K step 10.71 -> 9.61 ms).

:func:`install` does it without copying the model's weights: for each group (``self_attn``'s
q_proj, k_proj, v_proj; ``mlp``'s gate_proj, up_proj) it concatenates the members' weights (and
biases) into one tensor and points each member's Parameter at its rows (``param.data`` becomes a
view: the Parameter objects, their names in ``state_dict`` and their values stay; the memory is
what it was). Each member gets a ``forward`` (an instance attribute: ``nn.Module.__call__`` calls
``self.forward``, hooks still run around it). The group's first member (q_proj, gate_proj)
computes the whole GEMM and returns its columns; the others return theirs from that result when
called with the same input tensor, unchanged since (its ``_version``), as the layer's forward
calls them. Any other call computes its own ``F.linear`` as ``nn.Linear`` does: a member called
alone or first, another input, gradients on (the fused GEMM would not reach the Parameters), a
weight or bias replaced or moved since (``model.to``; ``load_state_dict`` copies in place, which
the views follow). The columns are views of the fused output (row stride the group's width): the
layer's ``.view(...).transpose(1, 2)`` and elementwise ops take them as they are.

Which modules: members exactly ``torch.nn.Linear`` (quantized or offloaded linears, accelerate's
device hooks, any ``forward`` of their own are left alone), of one dtype and device, with one
input width, all with a bias or none, not on the meta device. The results are the same math but
not bit for bit the separate GEMMs' (cuBLAS may split the longer weight differently). ``setting``
None fuses where the weights are on CUDA; True on any device (the CPU also runs fewer, larger
GEMMs); False never. :func:`uninstall` (``disable_hisparse_kv_cache``) deletes the forwards and
gives each member a weight (and bias) of its own again.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
MARK = "hisparse_fused_projection"      # attribute of an installed forward: its _Group


class _Group:
    """One group's fused weight (and bias), its members (weakly: the model owns them) and the
    last fused GEMM's input and output, which the other members take their columns from."""

    def __init__(self, members: list[torch.nn.Linear]) -> None:
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in members])
            self.bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
        self.members = [weakref.ref(m) for m in members]
        ends = list(itertools.accumulate(m.out_features for m in members))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.x: torch.Tensor | None = None       # the fused GEMM's input, its _version, its output
        self.version = -1
        self.y: torch.Tensor | None = None
        self.calls = 0                           # fused GEMMs run (tests count them)
        # what each member's weight and bias are while intact: (address, shape, dtype), or None
        self.views: list[tuple[tuple, tuple | None]] = []
        with torch.no_grad():
            for m, (lo, hi) in zip(members, self.bounds):
                m.weight.data = self.weight[lo:hi]
                if self.bias is not None:
                    m.bias.data = self.bias[lo:hi]
                self.views.append((_view(m.weight), _view(m.bias)))

    def intact(self, i: int, module: torch.nn.Module) -> bool:
        """Member i's weight and bias are still the views install made (not replaced or moved)."""
        return (_view(module.weight), _view(module.bias)) == self.views[i]

    def release(self) -> None:
        self.x = self.y = None


def _view(t: Any) -> tuple | None:
    return (t.data_ptr(), t.shape, t.dtype) if isinstance(t, torch.Tensor) else None


def _version(x: torch.Tensor) -> int:
    """x's version counter (bumped by in-place writes); inference tensors keep none: -1."""
    return -1 if x.is_inference() else x._version


def _needs_grad(x: torch.Tensor, module: torch.nn.Module) -> bool:
    b = module.bias
    return torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad
                                        or (b is not None and b.requires_grad))


def _fused_forward(group: _Group, i: int) -> Callable[..., Any]:
    """Member i's forward (module docstring): the fused GEMM for the first member, its columns of
    it for the others, ``nn.Linear``'s own computation otherwise."""
    ref = group.members[i]
    lo, hi = group.bounds[i]
    last = len(group.members) - 1

    def forward(*args: Any, **kwargs: Any) -> Any:
        module = ref()
        if module is None:
            raise RuntimeError("the linear module of this fused forward was deleted")
        x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 \
            else None
        if not isinstance(x, torch.Tensor) or not group.intact(i, module) or _needs_grad(x, module):
            if i == 0:
                group.release()
            return torch.nn.Linear.forward(module, *args, **kwargs)
        if i == 0:
            members = [r() for r in group.members]
            if x.dtype != group.weight.dtype or not all(
                    m is not None and group.intact(j, m) for j, m in enumerate(members)):
                group.release()
                return F.linear(x, module.weight, module.bias)
            group.y = F.linear(x, group.weight, group.bias)
            group.x, group.version = x, _version(x)
            group.calls += 1
            return group.y[..., lo:hi]
        y = group.y
        if y is None or group.x is not x or _version(x) != group.version:
            return F.linear(x, module.weight, module.bias)
        if i == last:                       # the layer's last member: nothing more takes from y
            group.release()
        return y[..., lo:hi]

    setattr(forward, MARK, group)
    forward.__doc__ = "torch.nn.Linear.forward, its GEMM fused with its layer's siblings' (hi_sparse fused_projections)"
    return forward


def candidates(layer: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """The groups of ``layer`` (a decoder layer) that qualify (module docstring)."""
    out = []
    for parent_name, names in GROUPS:
        parent = getattr(layer, parent_name, None)
        members = [getattr(parent, n, None) for n in names] if parent is not None else []
        if not members or not all(type(m) is torch.nn.Linear for m in members):
            continue
        w0 = members[0].weight
        if w0.device.type == "meta" or not w0.dtype.is_floating_point:
            continue
        if any("forward" in vars(m) or hasattr(m, "_hf_hook") or m.weight.dtype != w0.dtype
               or m.weight.device != w0.device or m.in_features != members[0].in_features
               or (m.bias is None) != (members[0].bias is None)
               or (m.bias is not None and (m.bias.dtype != w0.dtype or m.bias.device != w0.device))
               for m in members):
            continue
        out.append(members)
    return out


def install(layers: list[torch.nn.Module], setting: bool | None) -> list[_Group]:
    """Fuse the projections of the decoder ``layers`` that qualify; returns the groups, for
    :func:`uninstall`. ``setting``: the config's ``fused_projections`` (module docstring)."""
    if setting is False:
        return []
    groups = []
    for layer in layers:
        for members in candidates(layer):
            if setting is None and members[0].weight.device.type != "cuda":
                continue
            group = _Group(members)
            for i, m in enumerate(members):
                m.forward = _fused_forward(group, i)
            groups.append(group)
    log.debug("fused_projections: %d groups fused", len(groups))
    return groups


def uninstall(groups: list[_Group]) -> None:
    """Give each member its class's forward and a weight (and bias) of its own again (a forward
    someone installed over ours since is left in place; a weight replaced since is kept)."""
    with torch.no_grad():
        for group in groups:
            group.release()
            for i, ref in enumerate(group.members):
                m = ref()
                if m is None:
                    continue
                if getattr(vars(m).get("forward"), MARK, None) is group:
                    del m.forward
                if group.intact(i, m):
                    m.weight.data = m.weight.data.clone()
                    if m.bias is not None:
                        m.bias.data = m.bias.data.clone()
            group.weight = group.bias = None  # type: ignore[assignment]
