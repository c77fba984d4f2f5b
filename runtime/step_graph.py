"""A whole decode forward in one CUDA graph: every layer's HiSparse step and the model around it.

Eagerly, a decode step of a transformers model launches a few thousand kernels (norms,
projections, rotary embedding, MLP, and each layer's HiSparse append and attend), so one
sequence decodes far slower than its bytes allow. Per-layer graphs (batch_step.py) replay only
the HiSparse bodies. Here the decoder model's whole forward is captured once per batch and key
and replayed, the way transformers' static cache lets a dense model be captured:

- the engine does the host side of the step for every layer up front (``engine.plan_decode``:
  pages, positions and LRU clocks into device tensors, the bodies' shapes), so the forward's
  appends and attends are device work only, whose shapes and buffer addresses make the key;
- the forward runs eagerly the first time a batch steps (workspaces, compilation), is captured
  the second time, and replays while the key holds. Shapes are rounded up (decode.bucket), so
  the key changes a few times per doubling of the context, not every block; a new key of a batch
  that has replayed is captured at once (the kernels are loaded; an eager step first cost as much
  as the capture again), unless the capture meets a kernel Triton has not loaded (it cannot while
  a stream captures): that step runs eagerly and the next captures;
- afterwards the engine does what follows each body on the host (``engine.finish_decode``:
  lengths, selections, counters, the audit from the step's saved queries).

A step that cannot be planned runs layer by layer with per-layer graphs, as before: a forward
with more than one token, layers on several devices, gradients on, or arguments the graph cannot
hold (returned attentions or hidden states). A step whose token completes a block of a quantized
host pool is planned like any other: it reads the block from the float tail, and the engine seals
the block from there after the forward (``finish_decode``). Whole-step graphs are on with
``decode_graphs="step"`` (per-layer graphs with True, none with False). A capture that fails warns
once and the model goes on with per-layer graphs.

The wrapper is the decoder model's ``forward`` (an instance attribute, so the forward hooks of
integration.py still run around it) and is removed with the HiSparse cache.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import threading
import warnings
import weakref
from concurrent.futures import Future
from typing import Any

import torch

from . import hf_attention, hf_compat
from .batch_step import _cause, ahead_thread, capture, private_random_state, reset_off_step, warm_blas
from .probe import ImportanceProbe, fit_params
from .recalibration import audit_hits
from .row_bank import GrowthCopies, staged_view
from .streams import first_in_line

AHEAD_TOKENS = 256   # a key change this close is captured ahead, on another thread
# replay a step on the device's high-priority stream (streams.first_in_line): its kernels ahead of
# a background recalibration's (benchmarks turn it off to compare)
PRIORITY = True
# make the capture ahead's cuBLAS handles at install (batch_step.warm_blas): the step that starts
# the first capture ahead took 129 ms on the H200 without, 11 ms with (benchmarks/stall_profile.py
# --no-warm-blas to compare); and load the kernels of rare parts of a step (warm_first_launches)
WARM_BLAS = True
# forward arguments a graph holds: tensors copied into its inputs each step, flags that key it
_TENSORS = ("input_ids", "inputs_embeds", "position_ids", "cache_position")
_FLAGS = ("use_cache", "return_dict", "output_attentions", "output_hidden_states")


class WholeStep:
    """What one batch's whole-step graph holds."""

    def __init__(self, key: tuple, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor],
                 output: Any, tokens: list, queries: list) -> None:
        self.key, self.graph, self.inputs = key, graph, inputs
        self.tokens, self.queries = tokens, queries
        # the output without the cache the capture's caller passed: holding it would keep that
        # generate()'s sequences (host blocks, hot slots) alive after it returned
        # (the output's own keys: `in` on a 5.24+ output also finds the deprecated alias)
        self.cache_fields = [n for n in (hf_compat.NEW_NAME, hf_compat.OLD_NAME) if n in output.keys()]
        self.output = type(output)(**{k: v for k, v in output.items() if k not in self.cache_fields})


class Lookahead:
    """A graph being captured, on another thread, for a key a batch will have a few steps later."""

    def __init__(self, key: tuple, plan: Any) -> None:
        self.key, self.plan = key, plan
        self.done: Future | None = None           # its capture, on batch_step.ahead_thread()
        self.begun = threading.Event()            # set once the capture began (or failed before)
        self.have: WholeStep | None = None
        self.error: BaseException | None = None


class StepGraphs:
    """The decoder model's forward, with one-token decode steps run from whole-step graphs."""

    def __init__(self, binding: Any, base_model: torch.nn.Module) -> None:
        self.binding = binding
        # the model weakly (it holds this wrapper), and a wrapper someone else installed, kept
        self._model = weakref.ref(base_model)
        self._previous = vars(base_model).get("forward")
        params = inspect.signature(self.original).parameters
        self.cache_kwarg = hf_compat.cache_kwarg(self.original)
        self.takes_cache_position = "cache_position" in params
        engine = binding.engine
        devices = {layer.device for layer in engine.layers}
        self.graphs = (binding.config.decode_graphs == "step" and len(devices) == 1
                       and next(iter(devices)).type == "cuda")
        self.plan_on_cpu = False       # tests: plan every step without graphs (the same host side)
        # "capture_retried": captures of a new key that failed (then run eagerly, and captured at
        # the next step); "ahead": new keys replayed from a graph captured ahead; "ahead_failed":
        # keys whose capture ahead failed. capture_errors: why those captures failed (the last few)
        self.counts = {"eager": 0, "captured": 0, "replayed": 0, "layer_by_layer": 0, "capture_retried": 0,
                       "ahead": 0, "ahead_failed": 0}
        self.capture_errors: collections.deque[str] = collections.deque(maxlen=8)
        self.ahead = True          # capture a coming key's graph on another thread (AHEAD_TOKENS)
        self.ahead_at: collections.deque[int] = collections.deque(maxlen=8)   # the steps that began one (the last few)
        if self.graphs and WARM_BLAS:
            warm_blas(next(iter(devices)))
            warm_first_launches(engine, next(iter(devices)))

    @property
    def original(self) -> Any:
        """The forward this wraps."""
        if self._previous is not None:
            return self._previous
        model = self._model()
        return type(model).forward.__get__(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or not (self.graphs or self.plan_on_cpu) or not self._eligible(kwargs):
            return self.original(*args, **kwargs)
        ctx = hf_attention.current()
        engine = self.binding.engine
        plan = engine.plan_decode(ctx.sequences.seq_ids)
        if plan is None:
            self.counts["layer_by_layer"] += 1
            return self.original(**kwargs)
        cache = kwargs[self.cache_kwarg]
        lengths = [layer.length for layer in cache.layers]
        ran = done = False
        try:
            out = self._run(plan, self._call_kwargs(kwargs, cache), cache)
            ran = True
        finally:
            try:
                engine.finish_decode(plan, ran)      # a failure there (a seal) keeps the lengths too
                done = ran
            finally:
                for layer, n in zip(cache.layers, lengths):    # what each layer's update counts
                    layer.length = n + 1 if done else n
        return out

    def _eligible(self, kwargs: dict) -> bool:
        ctx = hf_attention.current()
        if ctx is None or ctx.binding is not self.binding or ctx.sequences is None or torch.is_grad_enabled():
            return False
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != 1:
            return False
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("use_cache") is False:
            return False
        known = set(_TENSORS) | set(_FLAGS) | {"attention_mask", self.cache_kwarg}
        return all(v is None for k, v in kwargs.items() if k not in known)

    def _call_kwargs(self, kwargs: dict, cache: Any) -> dict:
        """The forward's arguments with every tensor one a graph can hold: the mask dropped (the
        HiSparse mask function returns none, and the pre-hook has checked it), positions made
        tensors when missing (the model would make them from the cache's length on the host)."""
        call = {k: v for k, v in kwargs.items() if k != "attention_mask" and v is not None}
        x = call.get("input_ids", call.get("inputs_embeds"))
        if call.get("position_ids") is None and call.get("cache_position") is None:
            past = cache.get_seq_length()
            call["position_ids"] = torch.full((1, 1), past, dtype=torch.int64, device=x.device)
            if self.takes_cache_position:
                call["cache_position"] = torch.full((1,), past, dtype=torch.int64, device=x.device)
        return call

    def _run(self, plan: Any, call: dict, cache: Any) -> Any:
        if not self.graphs:
            self.counts["eager"] += 1
            return self.original(**call)
        tensors = {k: v for k, v in call.items() if k in _TENSORS}
        key = (plan.key, tuple((k, tuple(t.shape), t.dtype, t.device) for k, t in sorted(tensors.items())),
               tuple((k, call.get(k)) for k in _FLAGS))
        whole = plan.batch.whole
        have: WholeStep | None = whole.get("graph")
        if have is None or have.key != key:
            have = self._from_ahead(plan, key) or have
        if have is not None and have.key == key:
            for k, t in tensors.items():
                have.inputs[k].copy_(t)
            with first_in_line(self.binding.engine.layers[0].device) if PRIORITY else contextlib.nullcontext():
                have.graph.replay()
            plan.tokens[:], plan.q[:] = have.tokens, have.queries
            self.counts["replayed"] += 1
            self._look_ahead(plan, key, call, cache)
            return self._result(have, cache)
        if whole.get("warm") != key:
            # A new key of a batch that has replayed a graph (its context passed a bucket): the
            # same kernels at new sizes, captured at once; a first sight of the batch, or a
            # capture that fails (the first sight of a kernel specialization can: its compile),
            # runs eagerly first
            first = have is None
            whole.pop("graph", None)
            whole["warm"] = key
            if not first:
                try:
                    out = self._capture(plan, call, tensors, key, cache)
                except RuntimeError as exc:
                    self.counts["capture_retried"] += 1
                    self.capture_errors.append(_cause(exc))
                else:
                    self._look_ahead(plan, key, call, cache)
                    return out
            self.counts["eager"] += 1
            return self.original(**call)
        try:
            out = self._capture(plan, call, tensors, key, cache)
        except RuntimeError as exc:
            warnings.warn(f"HiSparse: CUDA graph capture of the whole decode step failed ({_cause(exc)}); the "
                          "model decodes layer by layer from now on (set decode_graphs=True to silence this)",
                          RuntimeWarning, stacklevel=2)
            self.graphs = False
            self.counts["eager"] += 1
            return self.original(**call)
        # a key change soon after a new batch (its prompt ended within AHEAD_TOKENS of a bucket):
        # its staging (~230 tensors at 32 layers) on this step, a capture's already, not the next
        self._look_ahead(plan, key, call, cache)
        return out

    def _capture(self, plan: Any, call: dict, tensors: dict, key: tuple, cache: Any) -> Any:
        """The forward captured under ``key`` and replayed once (this step's result)."""
        inputs = {k: t.clone() for k, t in tensors.items()}    # outside the graph's pool: they persist
        graph, output = capture(lambda: self.original(**{**call, **inputs}), torch.cuda.graph_pool_handle())
        # what the capture's bodies returned lives in the graph's pool, written by every replay
        whole = plan.batch.whole
        have = whole["graph"] = WholeStep(key, graph, inputs, output, list(plan.tokens), list(plan.q))
        self.binding.engine.ready_seal(plan)     # with this capture: not at the first completed block
        graph.replay()                           # capture records, it does not run
        self.counts["captured"] += 1
        return self._result(have, cache)

    def _from_ahead(self, plan: Any, key: tuple) -> WholeStep | None:
        """The graph captured ahead for ``key`` (waiting for it if it still captures), made
        the batch's; None without one. One whose step came with another key (a host pool grew
        since: its buffers moved) is dropped, its capture left to end on its own."""
        whole = plan.batch.whole
        ahead: Lookahead | None = whole.get("ahead")
        if ahead is None or (ahead.key != key and max(plan.starts) < max(ahead.plan.starts)):
            return None                              # none, or its step is still to come
        del whole["ahead"]
        if ahead.key != key:
            return None
        ahead.done.result()
        if ahead.have is None:
            self.counts["ahead_failed"] += 1
            self.capture_errors.append(f"ahead: {_cause(ahead.error)}" if ahead.error else "ahead: no graph")
            whole["ahead_failed"] = key
            return None
        _retire(whole.get("graph"))
        whole["graph"], whole["warm"] = ahead.have, key
        self.binding.engine.ready_seal(plan)
        self.counts["ahead"] += 1
        return ahead.have

    def _look_ahead(self, plan: Any, key: tuple, call: dict, cache: Any) -> None:
        """After a replayed or captured step: when the batch's key will change within AHEAD_TOKENS tokens (its
        longest sequence enters another bucket), capture that step's graph now on another thread,
        while this key replays (on the H200 a capture took 80-90 ms of host time at 32 layers, ~25
        steps). Looked for once per selection block; one at a time."""
        whole = plan.batch.whole
        at = (key, max(plan.starts) // self.binding.config.select_block)
        if not self.ahead or "ahead" in whole or whole.get("looked") == at:
            return
        whole["looked"] = at
        later = self.binding.engine.plan_later(plan, AHEAD_TOKENS)
        if later is None:
            return
        ahead = Lookahead((later.key, key[1], key[2]), later)
        if whole.get("ahead_failed") == ahead.key:
            return
        standin = copy.copy(cache)              # its layers count the capture's tokens, not the steps'
        standin.layers = [copy.copy(layer) for layer in cache.layers]
        tensors = {k: v for k, v in call.items() if k in _TENSORS}
        inputs = {k: t.clone() for k, t in tensors.items()}
        args = (ahead, hf_attention.current(), {**call, **inputs, self.cache_kwarg: standin}, inputs,
                torch.is_inference_mode_enabled())
        whole["ahead"] = ahead
        self.ahead_at.append(max(plan.starts))
        with private_random_state(self.binding.engine.layers[0].device):
            ahead.done = ahead_thread().submit(self._capture_ahead, *args)
            ahead.begun.wait()       # (well under a millisecond) the caller samples only after it

    def _capture_ahead(self, ahead: Lookahead, ctx: Any, call: dict, inputs: dict, inference: bool) -> None:
        """The worker of :meth:`_look_ahead`: the forward captured with ``ahead``'s plan, in this
        thread's planned step and forward context; a failure (e.g. a kernel Triton has not loaded
        for the new sizes) leaves ``ahead.have`` None and the step runs as without it."""
        device = self.binding.engine.layers[0].device     # (whole-step graphs: one device)
        try:
            with torch.inference_mode(inference), torch.no_grad(), torch.cuda.device(device), staged_view(), \
                    self.binding.engine.planned_in_this_thread(ahead.plan):
                hf_attention.push(ctx)
                try:
                    graph, output = capture(lambda: self.original(**call), torch.cuda.graph_pool_handle(),
                                            begun=ahead.begun.set)
                finally:
                    hf_attention.pop(ctx)
                _capture_copies(ahead.plan.copies)
            ahead.have = WholeStep(ahead.key, graph, inputs, output, list(ahead.plan.tokens), list(ahead.plan.q))
        except Exception as exc:       # noqa: BLE001 - any failure: the key is captured when it comes
            ahead.error = exc
        finally:
            ahead.begun.set()

    @staticmethod
    def _result(have: WholeStep, cache: Any) -> Any:
        """The captured output with this step's values: the hidden state copied out of the graph's
        buffer (the next replay overwrites it), the cache the caller passed."""
        fields = dict(have.output.items())
        fields["last_hidden_state"] = fields["last_hidden_state"].clone()
        out = type(have.output)(**fields)
        for name in have.cache_fields:
            out[name] = cache
        return out


def _capture_copies(copies: GrowthCopies | None) -> None:
    """The staged growths' copies of a key captured ahead in one graph (row_bank.GrowthCopies), on
    the capture-ahead thread after its step's capture; any failure leaves them to run one by one
    (and the step's graph captured)."""
    if copies is None or not copies.copies:
        return
    try:
        # (as a capture ahead: its thread's stream, the random state untouched, the graph uploaded)
        graph, _ = capture(copies.run, torch.cuda.graph_pool_handle(), begun=lambda: None)
    except Exception:          # noqa: BLE001 - the copies then run one by one
        return
    copies.retire = reset_off_step
    copies.graph = graph                     # last: the steps' thread may take it from now on


def _retire(have: WholeStep | None) -> None:
    """Destroy a replaced key's graph off the step that replaced it (batch_step.reset_off_step);
    its private pool is no other graph's."""
    if have is not None:
        reset_off_step(have.graph)


def warm_first_launches(engine: Any, device: torch.device) -> None:
    """Launch once, on zeros, the kernels that rare parts of a decode step launch first: CUDA loads
    a kernel at its first launch (lazy loading, its default). On the H100 the first recalibration's
    commit took 8.9-10.4 ms more in its foreach copy that way (probe.write_params; the anchors'
    copy, recal_job._write_anchors, has one of its own per dtype), and the first
    audit ~7 ms more than later ones (cuBLAS's first heuristics and its matmul's load)."""
    cfg, D = engine.cfg, engine.shape.head_dim
    with torch.no_grad():
        # a context of ~1K tokens, one sequence and a batch (cuBLAS picks its kernel by shape: at
        # 128 tokens the H200's first audit at ~1K still took 3.5x a step)
        for b, n in ((1, 1024), (8, 1024)):
            picked = torch.zeros(b, 4, dtype=torch.int64, device=device)
            audit_hits(torch.zeros(b, D, device=device), torch.zeros(b, n, D, device=device),
                       torch.ones(b, n, dtype=torch.bool, device=device), picked, max(1, cfg.audit_top_m),
                       engine.shape.scale, cfg.audit_measure)
        for dtype in (torch.float32, torch.int64):     # the probes' parameters; the anchors (and scores)
            a = torch.zeros(4, dtype=dtype, device=device)
            torch._foreach_copy_([a], [a + 1])
        # a probe fit's kernels (its Triton kernel with and without the logits, Adam's foreach ops):
        # else a recalibration's worker meets them first and loads them holding the GIL, beside a
        # step (the first fit's step took 18-30x the median at batch 1 on an H100; with this it
        # still took up to 9.8x there, the capture ahead beside it: docs/BENCHMARKS.md)
        rows = torch.zeros(16, D, device=device), torch.zeros(16, device=device)
        fit_params([ImportanceProbe(D).to(device)], [rows], steps=2)


def install(binding: Any, base_model: torch.nn.Module) -> StepGraphs:
    """Wrap ``base_model``'s forward (its signature kept: callers inspect it)."""
    graphs = StepGraphs(binding, base_model)

    @functools.wraps(graphs.original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return graphs(*args, **kwargs)

    forward.step_graphs = graphs
    base_model.forward = forward
    return graphs


def uninstall(base_model: torch.nn.Module) -> None:
    """Put back the forward :func:`install` wrapped."""
    forward = vars(base_model).get("forward")
    graphs = getattr(forward, "step_graphs", None)
    if graphs is None:
        return
    if graphs._previous is not None:
        base_model.forward = graphs._previous
    else:
        del base_model.forward


def of(model: torch.nn.Module) -> StepGraphs | None:
    """The whole-step graphs of a model with the HiSparse cache (its decoder model's), or None."""
    base_model = getattr(model, "base_model", model)
    return getattr(vars(base_model).get("forward"), "step_graphs", None)
