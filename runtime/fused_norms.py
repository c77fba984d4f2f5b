"""A model's RMSNorm modules as one Triton launch each (``fused_norms``, kernels/norm.py).

On CUDA a transformers RMSNorm launches about eight small kernels (to fp32, pow, mean, add eps,
rsqrt, mul, to dtype, weight mul): two per decoder layer and one at the end, ~500 of 1-2 us each
per decode step of a Llama-3-8B-shape model. :func:`install` gives each such module whose math
is transformers' LlamaRMSNorm a ``forward`` (an instance attribute: ``nn.Module.__call__`` calls
``self.forward``, hooks still run around it) that runs ``kernels.rms_norm``: one launch, output
from ``torch.empty``, no host sync, so the whole-step CUDA graph (step_graph.py) captures it.

Which modules: class name ending in "RMSNorm", a 1-D float ``weight`` Parameter, a float
``variance_epsilon``, on a device where kernels run Triton (``use_triton``: CUDA, or the
interpreter tests' HISPARSE_FORCE_TRITON=1), and no ``forward`` of its own already (a wrapper
someone else installed, such as accelerate's device hooks, is left alone). Each is checked
first (:func:`matches`): its own forward and the kernel on the same random rows with a random
weight must agree, so a norm with other math (Gemma's ``1 + weight``, a product rounded once in
fp32) stays untouched. With gradients on (training) the fused forward calls the module's own,
which autograd can differentiate; so does a call with other arguments.
:func:`uninstall` (``disable_hisparse_kv_cache``) deletes the instance attributes again.
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref
from typing import Any, Callable

import torch

from hi_sparse.kernels._dispatch import FLOAT_DTYPES, use_triton
from hi_sparse.kernels.norm import rms_norm

log = logging.getLogger(__name__)
FUSED_MARK = "hisparse_fused_norm"     # attribute of an installed forward: a weak reference to its module
CHECK_ROWS = 8


def is_candidate(module: torch.nn.Module) -> bool:
    """An RMSNorm-looking module that has no forward of its own installed (module docstring)."""
    weight = getattr(module, "_parameters", {}).get("weight")
    eps = getattr(module, "variance_epsilon", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.nn.Parameter)
            and weight.dim() == 1 and weight.shape[0] > 0 and weight.dtype in FLOAT_DTYPES
            and isinstance(eps, (int, float)) and not isinstance(eps, bool)
            and "forward" not in vars(module))


def _agree(got: Any, want: Any) -> bool:
    """fp32: every element within 1e-5 relative; fp16 / bf16: at most 1 % of the elements differ,
    none by more than 2e-2 relative (an ulp or two)."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or got.shape != want.shape \
            or got.dtype != want.dtype:
        return False
    half = want.dtype != torch.float32
    a, b = got.double(), want.double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return False
    diff = (a - b).abs()
    if not half:
        return bool((diff <= 1e-5 * b.abs()).all())
    return bool((diff <= 2e-2 * b.abs() + 1e-3).all()) and float((diff > 0).double().mean()) <= 0.01


def matches(module: torch.nn.Module, fused: Callable[..., torch.Tensor] | None = None) -> bool:
    """True when ``fused(x, weight, module.variance_epsilon)`` (default: kernels' ``rms_norm``, what
    the fused forward runs) computes what the module's own forward does: both on CHECK_ROWS random
    rows (of magnitudes 3 to 3e-3, so eps matters in some) with a random weight (a copy of the
    module holds it: the module's parameters are not touched), in the weight's dtype on its
    device. A forward that raises counts as a disagreement."""
    weight = module.weight
    n = int(weight.shape[0])
    g = torch.Generator().manual_seed(n)
    scale = 3 * 10.0 ** -(torch.arange(CHECK_ROWS)[:, None] % 4)     # rows where eps matters, too
    x = (scale * torch.randn(CHECK_ROWS, n, generator=g)).to(device=weight.device, dtype=weight.dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(device=weight.device, dtype=weight.dtype)
    probe = type(module).__new__(type(module))
    probe.__dict__.update(vars(module))
    probe._parameters = {**module._parameters, "weight": torch.nn.Parameter(w, requires_grad=False)}
    with torch.no_grad():
        try:
            want = type(module).forward(probe, x)
        except Exception:  # noqa: BLE001 - a module that cannot run on plain rows is not fused
            return False
        got = (fused or rms_norm)(x, w, module.variance_epsilon)
    return _agree(got, want)


def _fused_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """The module's new forward: the kernel for ``forward(hidden_states)`` without gradients, the
    class's own forward otherwise. It holds the module weakly (no reference cycle through the
    module's own attribute, so a deleted model frees its memory at once)."""
    ref = weakref.ref(module)
    original = type(module).forward
    signature = inspect.signature(original)
    name = next(iter(list(signature.parameters)[1:]), "hidden_states")

    def forward(*args: Any, **kwargs: Any) -> Any:
        self = ref()
        if self is None:
            raise RuntimeError("the RMSNorm module of this fused forward was deleted")
        x = None                                # the one input, positional or by its name
        if len(args) == 1 and not kwargs:
            x = args[0]
        elif not args and len(kwargs) == 1:
            x = kwargs.get(name)
        weight = self.weight
        if (not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.device != weight.device
                or x.dim() == 0 or x.shape[-1] != weight.shape[0]
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return original(self, *args, **kwargs)
        return rms_norm(x, weight, self.variance_epsilon)

    setattr(forward, FUSED_MARK, ref)
    setattr(forward, "__signature__", signature.replace(parameters=list(signature.parameters.values())[1:]))
    forward.__doc__ = f"{type(module).__name__}.forward as one Triton launch (hi_sparse fused_norms)"
    return forward


def install(model: torch.nn.Module, setting: bool | None) -> list[weakref.ref]:
    """Fuse the RMSNorm modules of ``model`` that qualify and agree (module docstring); returns
    weak references to the fused ones, for :func:`uninstall`. ``setting`` is the config's
    ``fused_norms``: False fuses nothing; None and True fuse where kernels run Triton (on the CPU
    nothing: there the module's torch code is what runs either way). Nothing is replaced until
    every module was checked, so a failing kernel leaves the model as it was (with a warning)."""
    if setting is False:
        return []
    found = [m for m in model.modules() if is_candidate(m) and m.weight.device.type != "meta"
             and use_triton(m.weight)]
    verdicts: dict[tuple, bool] = {}
    chosen = []
    try:
        for module in found:
            w = module.weight
            key = (type(module), w.shape[0], w.dtype, w.device, float(module.variance_epsilon))
            if key not in verdicts:
                verdicts[key] = matches(module)
            if verdicts[key]:
                chosen.append(module)
    except Exception as exc:  # noqa: BLE001 - the kernel failed (a Triton or driver problem): run unfused
        warnings.warn(f"HiSparse: the fused RMSNorm kernel failed ({type(exc).__name__}: {exc}); the model's "
                      "norms run unfused (fused_norms=False silences this)", RuntimeWarning, stacklevel=3)
        return []
    for module in chosen:
        module.forward = _fused_forward(module)
    log.debug("fused_norms: %d of %d RMSNorm modules fused (%d left: other math)", len(chosen), len(found),
              len(found) - len(chosen))
    return [weakref.ref(m) for m in chosen]


def uninstall(fused: list[weakref.ref]) -> None:
    """Give the modules :func:`install` fused their class's forward back (a forward someone
    installed over ours since is left in place)."""
    for ref in fused:
        module = ref()
        if module is None:
            continue
        mark = getattr(vars(module).get("forward"), FUSED_MARK, None)
        if mark is not None and mark() is module:
            del module.forward
