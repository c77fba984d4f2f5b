"""HiSparse configuration: one dataclass, validated with messages that name the fix.

Defaults follow SGLang's HiSparse (top_k 2048, hot buffer 2 x top_k); docs/runtime.md explains each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Union

from easymats.catalogue import QUANT_BITS as _CATALOGUE_BITS

QUANT_BITS = tuple(int(b) for b in _CATALOGUE_BITS)
Bits = Union[int, str, None]
# Per-sequence page tables and block bounds are sized by max_seq_len: past this a generate would
# fail at its first step with an allocator error instead of here.
MAX_SEQ_LEN = 1 << 24
AUDIT_MEASURES = ("mass", "top_m")
DECODE_GRAPHS = (True, False, "step")
NAME_BYTES = 64  # the telemetry segment's name field (easymats/layout.py NAME_FIELD)

# Integer options and their smallest allowed value (optional ones may also be None).
_INTS = {"max_seq_len": 1, "cache_block_size": 1, "window_size": 1, "global_tokens": 0, "sink_tokens": 0, "top_k": 1,
         "recalibrate_every": 1, "recalibrate_topk": 1, "recalibrate_queries": 1, "audit_every": 0,
         "audit_top_m": 1, "drift_window": 1, "prefetch_blocks": 0, "bound_group": 1, "seed": 0}
_OPTIONAL_INTS = {"device_buffer_tokens": 1, "host_pool_blocks": 1, "selection_block_size": 1}
_NUMBERS = ("drift_floor", "threshold_base", "threshold_min", "threshold_max", "recycle_grace_s",
            "publish_interval_s")
_OPTIONAL_NUMBERS = ("quant_error_budget",)


def _int_problem(name: str, value: object, lowest: int) -> str | None:
    what = "a positive integer" if lowest == 1 else f"an integer >= {lowest}"
    if isinstance(value, int) and not isinstance(value, bool):
        return None if value >= lowest else f"{name} must be {what}, got {value}"
    hint = ""
    if isinstance(value, str) and value.strip().isdigit():
        hint = f": pass {name}={int(value)} (a number, not a string)"
    elif isinstance(value, float):
        hint = f": pass a whole number, e.g. {name}={max(lowest, round(value))}"
    return f"{name} must be {what}, got {value!r} (a {type(value).__name__}){hint}"


def _number_problem(name: str, value: object) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return None
    return f"{name} must be a finite number, got {value!r} (a {type(value).__name__})"


def _name_problem(name: object) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        return f"name must be a non-empty string (the telemetry target name), got {name!r}"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return (f"name {name!r} contains NUL or another control character: use letters, digits and "
                "-_.:/ (it becomes the target label)")
    if len(name.encode("utf-8")) > NAME_BYTES:
        return f"name {name!r} is {len(name.encode('utf-8'))} bytes of UTF-8; at most {NAME_BYTES} bytes fit"
    return None


@dataclass(slots=True)
class HiSparseConfig:
    """Every knob of the runtime. Call :meth:`validate` (the engine does) before use."""

    max_seq_len: int = 32768
    cache_block_size: int = 512          # tokens per KV block (storage: host pool, quantization,
                                         # page tables, streaming eviction)
    selection_block_size: int | None = None   # tokens per selection block: key bounds are kept and
                                         # ranked at this granularity inside each storage block
                                         # (divides cache_block_size; None -> cache_block_size)
    window_size: int = 1024              # most recent tokens always selected
    global_tokens: int = 16              # anchors pinned per sequence, layer and KV head
    sink_tokens: int = 4                 # first tokens of each sequence always selected (attention
                                         # sinks; part of top_k)
    top_k: int = 2048                    # tokens attended per decode step and KV head
    device_buffer_tokens: int | None = None   # hot buffer slots per KV head; None -> 2 * top_k
    kv_dtype: object = None              # torch dtype of stored KV; None -> the engine's dtype
    host_kv_bits: Bits = None            # None: no quantization; 4/5/6/8 fixed; "auto": per unit the
                                         # fewest of 4/5/6 bits within the error budget; "budget":
                                         # the same over 4/5/6/8; "seed": the seed's bimodal rule
    quant_error_budget: float | None = None   # relative error allowed per unit by "auto" and "budget"
                                         # (None -> 0.03 for "auto", 0.02 for "budget")
    metadata_device: str = "cpu"         # where page tables live
    recalibrate_every: int = 32768       # tokens between scheduled recalibrations
    recalibrate_topk: int = 32           # tokens labelled as anchors when the probe is refit
    recalibrate_queries: int = 8         # recent decode queries kept per layer for re-scoring
    background_recalibration: bool | None = None   # recalibrate while the steps go on and use
                                         # the result some steps later; one due at a prefill's end
                                         # starts with the next step (the first token does not
                                         # wait for it). On CUDA a worker thread queues it on a side
                                         # stream (H200: 32K prefill 1.14x dense, 1.25x without); on
                                         # a CPU it runs in slices after each step (SmolLM2: the
                                         # slowest step 2.2x, 72x in the step). None: True. False: at
                                         # the end of the step that is due, waiting
    recalibration_lag: int | None = None  # a background recalibration is committed at the end
                                         # of the step this many decode steps after its launch,
                                         # waiting for it there (the same step whatever the
                                         # timing: reproducible decodes; it may stall a step).
                                         # None: with a worker thread (CUDA) at the first step end
                                         # after it finished, not before 32 steps; in slices (a
                                         # CPU) after 96 steps, each running its share
    audit_every: int = 16                # decode steps between audits (0 = never)
    audit_top_m: int = 8                 # true top-m tokens compared against the selection ("top_m")
    # what an audit measures: "mass", the share of the query's exact attention that fell on the
    # selected tokens (what quality follows: the hit rate falls as perplexity rises), or "top_m",
    # how many of the true top-m tokens were selected (needle recall; most sit in the window)
    audit_measure: str = "mass"
    drift_floor: float = 0.5             # audited hit rate below this triggers recalibration
    drift_window: int = 4                # audits averaged for the drift decision
    threshold_base: float = 0.5          # probe threshold at 128K context
    threshold_min: float = 0.05
    threshold_max: float = 0.95
    prefetch_blocks: int = 1             # next-ranked blocks loaded ahead per step (0 = off)
    bound_group: int = 16                # blocks per super-block: at long context selection scores
                                         # super-blocks first, then only the best ones' blocks
                                         # (1 = always score every block)
    decode_graphs: bool | str = "step"   # CUDA: "step", the whole decode forward of a transformers
                                         # model in one graph (step_graph.py), per-layer graphs where
                                         # a step cannot be planned or with the engine alone; True:
                                         # per-layer graphs only; False: launch the kernels each step
    recycle_grace_s: float = 0.1         # freed blocks stay reclaimable this long
    decode_kernels: bool = True          # CUDA: the decode step's selection ranking and assembly,
                                         # hot-buffer lookup, prefetch and install, key-bound
                                         # widening, swap-in rows and counters as Triton kernels
                                         # (kernels/select.py, lru.py, bounds.py, swap_in.py,
                                         # counts.py: 15 launches per layer and step, 18 past 64
                                         # heads in a batch, instead of 231;
                                         # H200, 1 x 32K at 49: 14.5 ms a step against 30.6); False:
                                         # their torch references. CPU: the references
    fused_norms: bool | None = None      # transformers models: each RMSNorm module (LlamaRMSNorm's
                                         # math, checked per module first) as one Triton launch
                                         # instead of ~8 kernels (kernels/norm.py, fused_norms.py).
                                         # None or True: where its weight is on CUDA (the CPU runs
                                         # the module's own torch code either way); False: never
    fused_rotary: bool | None = None     # transformers models: the rotary embedding of each layer's
                                         # q and k (the modeling module's apply_rotary_pos_emb,
                                         # checked bit for bit first) as one Triton launch instead
                                         # of ~10 kernels, inside the model's forwards only
                                         # (kernels/rotary.py, fused_rotary.py). None or True: where
                                         # the model is on CUDA; False: never
    fused_projections: bool | None = None  # transformers models: each layer's q, k and v projections
                                         # as one GEMM and its MLP's gate and up as one (their
                                         # weights made views of one tensor: no extra memory;
                                         # fused_projections.py). None: where the weights are on
                                         # CUDA; True: on any device; False: never
    streaming: bool = False              # bounded host pool overwrites unimportant blocks
    host_pool_blocks: int | None = None  # host pool capacity in blocks; None -> grows on demand
    telemetry: bool = True
    publish_interval_s: float = 0.005    # publish at most this often
    layer_metrics: bool = False          # also publish the audit per layer (2 series per layer and
                                         # target; off: the default series budget, docs/scaling.md)
    name: str | None = None              # telemetry target name; None -> "hisparse"
    seed: int = 0                        # audit sampling and probe init
    gauge_interval_s: float = 1.0        # when publishing, refresh the gauges that cost a device
                                         # reduction or a walk over every layer (anchors, residency,
                                         # memory) at most this often

    @property
    def select_block(self) -> int:
        """Tokens per selection block (the unit the key bounds rank)."""
        return self.selection_block_size if self.selection_block_size is not None else self.cache_block_size

    @property
    def prefetch_units(self) -> int:
        """Selection blocks prefetched per step: ``prefetch_blocks`` storage blocks' worth of tokens."""
        return self.prefetch_blocks * self.cache_block_size // self.select_block

    @property
    def buffer_tokens(self) -> int:
        """Hot buffer slots per sequence, layer and KV head."""
        return self.device_buffer_tokens if self.device_buffer_tokens is not None else 2 * self.top_k

    # Over 60 lines on purpose: a flat list of one-line checks, one per option or pair of options,
    # read top to bottom like the option table of docs/runtime.md; splitting it would scatter it.
    def validate(self) -> "HiSparseConfig":
        """Raise ValueError naming the fix for any inconsistent setting; returns self."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"HiSparseConfig: {msg}")

        # Types first: every later check compares numbers.
        for f, lowest in _INTS.items():
            problem = _int_problem(f, getattr(self, f), lowest)
            need(problem is None, problem or "")
        for f, lowest in _OPTIONAL_INTS.items():
            if getattr(self, f) is not None:
                problem = _int_problem(f, getattr(self, f), lowest)
                need(problem is None, problem or "")
        for f in _NUMBERS + _OPTIONAL_NUMBERS:
            if f in _NUMBERS or getattr(self, f) is not None:
                problem = _number_problem(f, getattr(self, f))
                need(problem is None, problem or "")
        problem = _name_problem(self.name)
        need(problem is None, problem or "")
        need(self.max_seq_len <= MAX_SEQ_LEN,
             f"max_seq_len={self.max_seq_len} is more than HiSparse supports ({MAX_SEQ_LEN} tokens): "
             "per-sequence tables are sized by it; set it to the longest prompt + max_new_tokens you run")
        need(self.window_size <= self.max_seq_len,
             f"window_size ({self.window_size}) must be <= max_seq_len ({self.max_seq_len}): a window "
             "longer than any sequence is the whole sequence; lower window_size")
        need(0 < self.threshold_base < 1,
             f"threshold_base must be between 0 and 1 (the probe's anchor threshold at 128K context, a "
             f"probability), got {self.threshold_base}")
        need(self.cache_block_size % self.select_block == 0,
             f"selection_block_size ({self.select_block}) must divide cache_block_size "
             f"({self.cache_block_size}): a selection block is a run of rows of one storage block; "
             "pick a divisor such as 8, 16 or 32 (or None for whole storage blocks)")
        need(self.window_size <= self.top_k,
             f"window_size ({self.window_size}) must be <= top_k ({self.top_k}): raise top_k or "
             "lower window_size")
        need(self.window_size + self.global_tokens <= self.top_k,
             f"window_size + global_tokens ({self.window_size} + {self.global_tokens}) must be <= "
             f"top_k ({self.top_k}): raise top_k or lower global_tokens")
        need(self.window_size + self.sink_tokens <= self.top_k,
             f"window_size + sink_tokens ({self.window_size} + {self.sink_tokens}) must be <= top_k "
             f"({self.top_k}): raise top_k or lower sink_tokens")
        need(self.buffer_tokens >= self.top_k,
             f"device_buffer_tokens ({self.buffer_tokens}) must be >= top_k ({self.top_k}): every "
             "selected token needs a hot buffer slot (leave it None for 2 * top_k)")
        need(self.host_kv_bits in (None, "auto", "budget", "seed") + QUANT_BITS,
             f"host_kv_bits must be None, 4, 5, 6, 8, 'auto', 'budget' or 'seed', got {self.host_kv_bits!r}")
        need(self.quant_error_budget is None or 0 < self.quant_error_budget < 1,
             f"quant_error_budget must be in (0, 1) or None (the policy's default), got {self.quant_error_budget}")
        need(self.metadata_device in ("cpu", "device"),
             f"metadata_device must be 'cpu' or 'device', got {self.metadata_device!r}")
        need(self.recalibrate_every >= 1, "recalibrate_every must be >= 1 token")
        need(self.recalibrate_topk >= 1, "recalibrate_topk must be >= 1")
        need(self.recalibrate_queries >= 1, "recalibrate_queries must be >= 1")
        need(self.audit_every >= 0, "audit_every must be >= 0 (0 disables the audit)")
        need(self.audit_top_m >= 1, "audit_top_m must be >= 1")
        need(self.decode_graphs in DECODE_GRAPHS and isinstance(self.decode_graphs, bool | str),
             f"decode_graphs must be True, False or 'step', got {self.decode_graphs!r}")
        need(self.background_recalibration is None or isinstance(self.background_recalibration, bool),
             f"background_recalibration must be True, False or None (True), "
             f"got {self.background_recalibration!r}")
        need(self.recalibration_lag is None or (isinstance(self.recalibration_lag, int)
                                                and not isinstance(self.recalibration_lag, bool)
                                                and self.recalibration_lag >= 0),
             f"recalibration_lag must be None or a number of decode steps >= 0, got {self.recalibration_lag!r}")
        need(isinstance(self.decode_kernels, bool),
             f"decode_kernels must be True or False, got {self.decode_kernels!r}")
        for name in ("fused_norms", "fused_rotary", "fused_projections"):
            value = getattr(self, name)
            need(value is None or isinstance(value, bool),
                 f"{name} must be True, False or None (fused on CUDA), got {value!r}")
        need(self.audit_measure in AUDIT_MEASURES,
             f"audit_measure must be one of {', '.join(map(repr, AUDIT_MEASURES))}, got {self.audit_measure!r}")
        need(0.0 <= self.drift_floor <= 1.0, f"drift_floor must be in [0, 1], got {self.drift_floor}")
        need(self.drift_window >= 1, "drift_window must be >= 1")
        need(0 < self.threshold_min <= self.threshold_max < 1,
             "need 0 < threshold_min <= threshold_max < 1")
        need(self.prefetch_blocks >= 0, "prefetch_blocks must be >= 0")
        need(isinstance(self.bound_group, int) and not isinstance(self.bound_group, bool) and self.bound_group >= 1,
             f"bound_group must be an integer >= 1 (1 scores every block), got {self.bound_group!r}")
        need(self.recycle_grace_s >= 0, "recycle_grace_s must be >= 0")
        need(self.publish_interval_s >= 0, "publish_interval_s must be >= 0")
        need(self.gauge_interval_s >= 0, "gauge_interval_s must be >= 0 (0 refreshes every gauge at every publish)")
        if self.host_pool_blocks is not None:
            need(self.host_pool_blocks >= 1, "host_pool_blocks must be >= 1 (or None to grow)")
        if self.streaming:
            need(self.host_pool_blocks is not None,
                 "streaming=True needs a bounded host pool: set host_pool_blocks")
        return self

    def as_labels(self) -> dict[str, str]:
        """Values for the hisparse_config_info metric."""
        return {"window_size": str(self.window_size), "global_tokens": str(self.global_tokens),
                "block_size": str(self.cache_block_size), "top_k": str(self.top_k),
                "device_buffer_tokens": str(self.buffer_tokens),
                "host_kv_bits": "none" if self.host_kv_bits is None else str(self.host_kv_bits)}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
