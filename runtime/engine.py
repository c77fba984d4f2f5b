"""The HiSparse engine: the public API over the host pool, hot buffers, selection and attention.

Driven per layer by a model integration (no transformers import here)::

    eng = HiSparseEngine(cfg, num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    ids = eng.add_sequences(B)
    eng.begin_step()
    for layer in range(L):
        eng.append(layer, ids, k, v)       # (B, Hkv, T, D): stored to host, made hot
        out = eng.attend(layer, ids, q)    # (B, Hq, Tq, D): exact causal if Tq > 1, sparse if 1
    eng.end_step()                         # timing, audit bookkeeping, recalibration, publish
Several GPUs: ``layer_devices`` puts each layer's hot buffer and per-layer metadata on its own
device (the layers of a model split with a device_map); the host pool is shared (pinned, UVA).

This module wires the parts and keeps the public API; each job lives in its own module
(docs/architecture.md): sequences.py (sequences and rows), storage.py (blocks, eviction),
decode.py (the append and the decode step), prefill.py, recalibration.py (audit, anchors and
probe refits), metrics.py (counters, memory, publishing), control.py (requests from the agent).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from . import __version__
from .block_pool import BlockPool
from .config import HiSparseConfig
from .control import ControlReader
from .decode import Ahead, Decoder, StepPlan
from .host_pool import HostPool
from .layers import KVShape, LayerRows, devices_per_layer, normalize_device
from .metrics import DeviceCounters, Gauges, Publisher, RuntimeMetrics, Stats
from .page_table import PageTable
from .prefill import ContextReader, PrefillAttention
from .probe import ImportanceProbe
from .recal_job import RecalibrationJob
from .recalibration import REASONS, Audit, RecalibrationController, Recalibrator
from .sequences import SequenceTable
from .storage import Storage

# decode steps before a worker's recalibration is used, at least (recalibration_lag None; ~250-600
# ms of host time at 32 layers on the H200, 50-130 steps of 1-3K tokens; a slower one lands when
# done), and after which one in slices (a CPU's) lands, whatever the timing (each step runs its share)
WORKER_LAG, SLICE_LAG = 32, 96


class HiSparseEngine:
    # prepare the next planned step at a step's end, while its graph runs (False: for an A/B)
    plan_ahead: bool
    _next: list[int] | None          # the sequences of the last planned step
    _ahead: Ahead | None             # what was prepared for them
    _audited: list[float] | None = None   # the step's audit: lookups and hits summed (end_step records it)

    def __init__(self, cfg: HiSparseConfig, num_layers: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 model_name: str = "llama", segment=None,
                 layer_devices: Sequence[torch.device | str] | None = None) -> None:
        """device: the primary device (page tables with metadata_device="device", the info label);
        layer_devices: the device of each layer's hot buffer and per-layer metadata (default: all
        on ``device``). Layers on different GPUs share one pinned host pool."""
        cfg.validate()
        if num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
            raise ValueError("num_layers, num_kv_heads and head_dim must be >= 1")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads}) (grouped-query attention)")
        self.cfg = cfg
        self.device = torch.device(device)
        devices = self.layer_devices = devices_per_layer(layer_devices, num_layers, normalize_device(self.device))
        self.shape = shape = KVShape(num_layers, num_q_heads, num_kv_heads, head_dim, cfg.cache_block_size,
                                     cfg.buffer_tokens, cfg.kv_dtype or dtype)
        self.meta_device = normalize_device(self.device) if cfg.metadata_device == "device" else torch.device("cpu")
        self._owned_segment = segment is None and cfg.telemetry
        if self._owned_segment:
            from easymats import telemetry
            segment = telemetry.open_segment(cfg.name or "hisparse", labels={"model": model_name})
        self.metrics = metrics = RuntimeMetrics(segment, num_layers if cfg.layer_metrics else 0)
        metrics.info({"version": __version__, "model": model_name, "device": str(self.device)}, cfg.as_labels())
        self.pool = BlockPool(0, grace_s=cfg.recycle_grace_s,
                              counters={"allocations": metrics.block_allocations, "recycles": metrics.block_recycles,
                                        "reclaims": metrics.block_reclaims})
        self.pages = PageTable(self.pool, cfg.cache_block_size)
        self.host = HostPool(num_layers, num_kv_heads, head_dim, cfg.cache_block_size, shape.dtype,
                             pin=torch.cuda.is_available() and any(d.type == "cuda" for d in devices + [self.device]),
                             host_kv_bits=cfg.host_kv_bits, error_budget=cfg.quant_error_budget)
        if cfg.host_pool_blocks:
            self.pool.grow(cfg.host_pool_blocks)
            self.host.grow(blocks=cfg.host_pool_blocks)
        self.layers = self._layers(devices)
        self._background = cfg.background_recalibration is not False
        self._sequences = SequenceTable(cfg, self.layers, self.host, self.pages)
        self._storage = Storage(cfg, self.pool, self.pages, self.host, self.layers, self._sequences, metrics)
        self._decoder = Decoder(cfg, shape, self.layers, self.host, self._storage, self._sequences, metrics)
        reader = ContextReader(self.host, self.pages, self._storage, cfg.cache_block_size)
        self._prefill = PrefillAttention(shape, reader)
        self._recalibrator = Recalibrator(cfg, shape, self.layers, reader)
        self.recal = RecalibrationController(cfg.recalibrate_every, cfg.drift_floor, cfg.drift_window)
        self._recal_job: RecalibrationJob | None = None     # a background recalibration not yet committed
        self._recal_deferred: str | None = None  # the reason of one due at a prefill's end, not yet launched
        self.host.before_grow = self.settle_recalibration
        self._rng = random.Random(cfg.seed)
        self.decode_steps = 0
        self.recent_audits: deque[Audit] = deque(maxlen=256)   # the last audits, for inspection
        self._step_t0: float | None = None
        self._step_decoded = False
        self._audit_at: tuple[int, int] | None = None
        self.plan_ahead, self._next, self._ahead = True, None, None
        self._gauges = Gauges(metrics, cfg, shape, self.layers, self.pool, self.pages, self.host, self._sequences,
                              self.meta_device)
        self.publisher = Publisher(metrics, self._gauges, cfg.publish_interval_s, cfg.gauge_interval_s)
        self._control = ControlReader(segment)
        self.publisher.maybe_publish(force=True)

    def _layers(self, devices: list[torch.device]) -> list[LayerRows]:
        # Triton launches on the current CUDA device and stream: with layers on several GPUs (or
        # one that is not the current) each layer's work runs under its device
        cuda = sorted({d.index for d in devices if d.type == "cuda"})
        switch = len(cuda) > 1 or (len(cuda) == 1 and cuda[0] != torch.cuda.current_device())
        counters = {d: DeviceCounters(d) for d in dict.fromkeys(devices)}
        cfg = self.cfg
        return [LayerRows(i, d, self.shape, cfg.global_tokens, cfg.recalibrate_queries, cfg.max_seq_len,
                          ImportanceProbe(self.shape.head_dim, seed=cfg.seed + i).to(d), counters[d],
                          switch and d.type == "cuda", cfg.decode_kernels)
                for i, d in enumerate(devices)]

    # -- what tests, benchmarks and the integration read ----------------------------------------
    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def seqs(self) -> dict:
        """The live sequences by id (hi_sparse.sequences.Sequence)."""
        return self._sequences.live

    @property
    def probes(self) -> list[ImportanceProbe]:
        return [layer.probe for layer in self.layers]

    @property
    def k_hot(self) -> list[torch.Tensor]:
        """Each layer's hot keys (rows, Hkv, S, D)."""
        return [layer.k for layer in self.layers]

    @property
    def v_hot(self) -> list[torch.Tensor]:
        return [layer.v for layer in self.layers]

    # -- sequences -----------------------------------------------------------------------------
    def add_sequences(self, batch_size: int, pad_lengths: list[int] | None = None) -> list[int]:
        """Register ``batch_size`` new sequences (left padding per sequence); returns their ids."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pads = list(pad_lengths) if pad_lengths is not None else [0] * batch_size
        if len(pads) != batch_size or any(p < 0 for p in pads):
            raise ValueError(f"pad_lengths must be {batch_size} non-negative ints, got {pad_lengths!r}")
        ids = [s.seq_id for s in self._sequences.add(pads)]
        self.publisher.maybe_publish()
        return ids

    def fork_sequences(self, seq_id: int, copies: int) -> list[int]:
        """``copies`` new sequences that continue from ``seq_id`` as it is now (n samples of one
        prompt: transformers' ``batch_repeat_interleave``). They share the source's full host
        blocks (copy on write: reference counts; only a partly filled last block is copied), so a
        fork costs no host copy of the context; each gets its own key bounds, anchors, recent
        queries and hot buffer, in consecutive rows (so the source and its copies decode as one
        batch when they are consecutive too). Returns their ids.
        """
        src = self._sequences.get(seq_id)
        self.settle_recalibration()        # the copies take the source's anchors as they will be
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        if self._storage.has_holes(src):
            raise ValueError(f"sequence {seq_id} lost blocks to streaming eviction; it cannot be forked")
        if len(set(src.lengths)) != 1:
            raise ValueError(f"sequence {seq_id} is in the middle of a step (its layers hold "
                             f"{sorted(set(src.lengths))} tokens): fork between forward passes")
        ids = [s.seq_id for s in self._sequences.fork(src, copies, self._storage.allocate)]
        self.publisher.maybe_publish()
        return ids

    def seq_len(self, seq_id: int) -> int:
        """Tokens held for a sequence (including its left padding)."""
        return self._sequences.get(seq_id).length

    def free_sequences(self, seq_ids: list[int]) -> None:
        """Release sequences; their host blocks stay reclaimable for recycle_grace_s (resume)."""
        job = self._recal_job              # it may still read their blocks: settled, or its reads run
        if self._recal_deferred is not None or job is None or not job.release({*seq_ids}):
            self.settle_recalibration()
        self._ahead = None                 # a step prepared for them (or others: prepared again)
        self._sequences.free(seq_ids)
        self._decoder.forget(seq_ids)
        self._prefill.forget(seq_ids)
        self.publisher.maybe_publish(settle=True)   # a request's end: its last counts, exactly

    def resume_sequence(self, seq_id: int) -> bool:
        """Take back a freed sequence within its grace period (its blocks are reclaimed).

        Returns False when it is too late (the blocks were recycled); the caller then re-prefills.
        """
        resumed = self._sequences.resume(seq_id)
        if resumed:
            self.publisher.maybe_publish()
        return resumed

    # -- append and attend ---------------------------------------------------------------------
    def append(self, layer: int, seq_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. k, v: (B, Hkv, T, D) for sequences ``seq_ids`` at ``layer``."""
        seqs = self._batch_of(layer, seq_ids)
        H, D = self.shape.num_kv_heads, self.shape.head_dim
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != len(seq_ids) or k.shape[1] != H or k.shape[3] != D:
            raise ValueError(f"append expects k and v of shape (B={len(seq_ids)}, Hkv={H}, T, "
                             f"D={D}); got {tuple(k.shape)} and {tuple(v.shape)}")
        T = k.shape[2]
        if T == 0:
            return
        rows = self.layers[layer]
        k, v = k.to(rows.device, self.shape.dtype), v.to(rows.device, self.shape.dtype)
        if self._decoder.planned is None:
            self._launch_deferred()    # from the state before the append
        with rows.on_device():
            self._decoder.append(rows, seqs, k, v)
        if self._decoder.planned is not None:
            return                       # a planned step: its host side is finish_decode's
        self._prefill.keep(layer, seqs, k, v)
        if layer == 0:
            (self.metrics.tokens_prefill if T > 1 else self.metrics.tokens_decode).inc(T * len(seqs))
            self.recal.on_tokens(T * len(seqs))

    def attend(self, layer: int, seq_ids: list[int], q: torch.Tensor) -> torch.Tensor:
        """Attention for the last Tq appended tokens. q (B, Hq, Tq, D) -> (B, Hq, Tq, D): from a decode
        graph (decode_graphs), its output buffer, which the layer's next step overwrites."""
        seqs = self._batch_of(layer, seq_ids)
        Hq, D = self.shape.num_q_heads, self.shape.head_dim
        if q.dim() != 4 or q.shape[0] != len(seq_ids) or q.shape[1] != Hq or q.shape[3] != D:
            raise ValueError(f"attend expects q of shape (B={len(seq_ids)}, Hq={Hq}, Tq, D={D}); "
                             f"got {tuple(q.shape)}")
        Tq = q.shape[2]
        for s in seqs:
            if s.lengths[layer] < Tq:
                raise ValueError(f"attend at layer {layer}: sequence {s.seq_id} holds {s.lengths[layer]} "
                                 f"tokens but q has {Tq}; append k/v for this layer first")
        rows = self.layers[layer]
        qd = q.to(rows.device)  # a no-op when q is already on the layer's device
        with rows.on_device():
            plan = self._decoder.planned
            if plan is not None:
                if Tq != 1 or len(seqs) != len(plan.seqs):
                    raise ValueError(f"attend at layer {layer}: a planned decode step takes one token of "
                                     f"{len(plan.seqs)} sequences, got q of shape {tuple(q.shape)}")
                plan.q[layer] = qd[:, :, 0]
                return self._decoder.attend(rows, seqs, qd[:, :, 0])[:, :, None].to(q.device)
            if Tq == 1:
                out = self._decoder.attend(rows, seqs, qd[:, :, 0])[:, :, None]
                self._step_decoded = True
                if self._audit_at is not None and self._audit_at[0] == layer:
                    self._audit(rows, seqs, qd[:, :, 0])
            else:
                out = torch.stack([self._prefill.attend(rows, s, qd[b]) for b, s in enumerate(seqs)])
        return out.to(q.device)

    # -- a decode step planned for all layers at once (one CUDA graph of the whole forward) -----
    def plan_decode(self, seq_ids: list[int]) -> StepPlan | None:
        """Do the host side of a one-token decode step of ``seq_ids`` for every layer now, so that
        the step's appends and attends run (or replay from one graph) without it; None when this
        step must run layer by layer (decode.Decoder.plan says when). Until :meth:`finish_decode`,
        append and attend run the planned step's bodies only."""
        seqs = self._batch_of(0, seq_ids)
        ahead, self._ahead = self._ahead, None
        if any(len(set(s.lengths)) != 1 for s in seqs):
            return None                  # a forward stopped part-way left the layers uneven
        self._launch_deferred()
        plan = self._decoder.plan(seqs, ahead)
        self._decoder.planned = plan
        return plan

    def plan_later(self, plan: StepPlan, within: int) -> StepPlan | None:
        """The first step within ``within`` tokens after ``plan`` whose graph would need a new key
        (decode.Decoder.later), planned without changing anything; None if none comes so soon."""
        return self._decoder.later(plan, within)

    @contextlib.contextmanager
    def planned_in_this_thread(self, plan: StepPlan) -> Iterator[None]:
        """append and attend run ``plan``'s bodies in this thread only (a later key's step captured
        on another thread while steps go on: step_graph.py)."""
        self._decoder.planned = plan
        try:
            yield
        finally:
            self._decoder.planned = None

    def ready_seal(self, plan: StepPlan) -> None:
        """Get the seal of blocks ``plan``'s batch will complete ready (Decoder.ready_seal)."""
        self._decoder.ready_seal(plan)

    def finish_decode(self, plan: StepPlan, ran: bool = True) -> None:
        """After a planned step's forward: the host side of every layer's append and attend, the
        step's counters and its audit. ``ran`` False: the forward failed, so the plan is dropped
        (the batch's graphs with it) and the sequences keep their lengths."""
        self._decoder.planned = None
        if not ran:
            self._decoder.forget([s.seq_id for s in plan.seqs])
            return
        self._decoder.finish(plan)
        if self.plan_ahead:
            self._next = [s.seq_id for s in plan.seqs]
        B = len(plan.seqs)
        self.metrics.tokens_decode.inc(B)
        self.recal.on_tokens(B)
        self._step_decoded = True
        if self._audit_at is not None:
            layer = self._audit_at[0]
            rows = self.layers[layer]
            with rows.on_device():
                self._audit(rows, plan.seqs, plan.q[layer])

    def _batch_of(self, layer: int, seq_ids: list[int]) -> list:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range: the engine has {self.num_layers} layers "
                             f"(0..{self.num_layers - 1})")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids {list(seq_ids)} repeat an id: pass each sequence once per call")
        return [self._sequences.get(i) for i in seq_ids]

    def selection(self, layer: int, seq_id: int) -> torch.Tensor | None:
        """The token positions (Hkv, K), -1 padded, selected at the last decode step (for tests)."""
        return self._sequences.get(seq_id).selection(layer)

    # -- audit and recalibration ---------------------------------------------------------------
    def _audit(self, rows: LayerRows, seqs: list, q: torch.Tensor) -> None:
        head = self._audit_at[1]
        # the step's audit is one audit to the drift decision, whatever its batch or how many
        # calls its sequences came in (drift_window counts audits: with an entry per sequence, a
        # window of 4 was judged on one audit of a batch of 24): summed here, recorded at end_step
        audited = self._audited or [0.0, 0.0]
        for lookups, hits in self._recalibrator.audit(rows, seqs, q, head):
            self.metrics.anchor_lookups.inc(lookups)
            self.metrics.anchor_hits.inc(hits)
            if self.metrics.audit_lookups:          # opt-in per-layer detail
                self.metrics.audit_lookups[rows.index].inc(lookups)
                self.metrics.audit_hits[rows.index].inc(hits)
            audited[0] += lookups
            audited[1] += hits
            self.recent_audits.append(Audit(self.decode_steps, rows.index, head, lookups, hits))
        self._audited = audited

    def request_recalibration(self, reason: str = "request") -> None:
        """Ask for a recalibration at the end of the current (or next) step."""
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
        self.recal.request(reason)

    # -- steps ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Mark the start of one forward pass over all layers."""
        self._step_t0 = time.perf_counter()
        self._step_decoded = False
        self._launch_deferred()
        every = self.cfg.audit_every
        if every and (self.decode_steps + 1) % every == 0:
            self._audit_at = (self._rng.randrange(self.num_layers), self._rng.randrange(self.shape.num_q_heads))
        else:
            self._audit_at = None

    def end_step(self) -> None:
        """Finish a step: time it, maybe recalibrate, answer control requests, publish."""
        took = None if self._step_t0 is None else time.perf_counter() - self._step_t0
        if self._step_decoded:
            self.decode_steps += 1
            if took is not None:
                self.metrics.step_duration.observe(took)
        self._step_t0 = None
        self._audit_at = None
        if self._audited is not None:
            self.recal.on_audit(*self._audited)
            self._audited = None
        self._prefill.end_step()
        self._decoder.flush_quant_errors()
        job = self._recal_job
        # a request while one requested runs is answered by it (its landing acknowledges the latest)
        if self._control.recalibration_requested() and "request" not in (self._recal_deferred, job and job.reason):
            self.recal.request("request")
        live = list(self._sequences.live.values())
        ready = any(s.queries_kept[0] and s.lengths[0] - s.first_token > self.cfg.top_k for s in live)
        if job is not None:          # a CPU's: its next slices, a step's time or its share by its step
            job.advance(took or 0.0, max(1, job.due - self.decode_steps + 1))
        self.settle_recalibration(wait=False)       # a background one the device finished
        reason = self.recal.due(ready) if self._recal_job is None and self._recal_deferred is None else None
        if reason is not None:
            self.recal.start(reason)
            background = self._background and not self.cfg.streaming
            if background and not self._step_decoded:
                # due at a prefill's end: launched when the next step begins, after the first
                # token's logits (the prefill's last work, which it would compete with)
                self._recal_deferred = reason
            else:
                self._launch(live, reason, background)
        self.pool.recycle_expired()
        self._sequences.expire(time.monotonic())
        self.publisher.maybe_publish()
        self._prepare_next()

    def _prepare_next(self) -> None:
        """After a planned step: the next step of its sequences prepared now, while the device
        still runs this one (decode.Decoder.prepare; plan_decode checks it still holds)."""
        ids, self._next = self._next, None
        seqs = [self._sequences.live.get(i) for i in ids or ()]
        if seqs and all(s is not None and len(set(s.lengths)) == 1 for s in seqs):
            try:
                self._ahead = self._decoder.prepare(seqs)
            except (RuntimeError, ValueError):
                # speculative (the step may never come): a failure here must not fail the step
                # that ran; the next plan prepares again, and raises then if it still fails
                self._ahead = None

    def _launch(self, live: list, reason: str, background: bool) -> None:
        job = self._recalibrator.start(live, reason, background=background)
        if job.background:
            lag = self.cfg.recalibration_lag
            job.due = self.decode_steps + (lag if lag is not None else WORKER_LAG if job.threaded else SLICE_LAG)
            self._recal_job = job
        else:
            job.commit()
            self._recalibrated(reason)

    def _launch_deferred(self) -> None:
        """Launch the background recalibration that came due at a prefill's end (from the state
        the prefill left: nothing has changed it since). Appends need not wait for one running:
        it reads copies of what they change (the float tails a next block reuses, recent queries;
        recal_job.py), and what would free or move the blocks it reads (a free, a fork, a growing
        pool) settles it first."""
        reason, self._recal_deferred = self._recal_deferred, None
        if reason is not None:
            self._launch(list(self._sequences.live.values()), reason, background=True)

    def settle_recalibration(self, wait: bool = True) -> bool:
        """Commit a background recalibration (``background_recalibration``): now, waiting for
        it if it has not finished (``wait``: one still deferred is launched first), or only if it
        is due (``recalibration_lag``: at its step, waiting; else once it finished, no sooner
        than its step). True when none is left."""
        if wait:
            self._launch_deferred()
        job = self._recal_job
        if job is not None and (wait or (self.decode_steps >= job.due
                                         and (self.cfg.recalibration_lag is not None or job.ready()))):
            self._recal_job = None         # one that failed is dropped: commit raises its error
            if job.commit():               # (one an interrupt broke off: nothing to count)
                self._recalibrated(job.reason)
        return self._recal_job is None and self._recal_deferred is None

    def _recalibrated(self, reason: str) -> None:
        self.recal.done(reason)
        self.metrics.recalibrations[reason].inc()
        if reason == "request":
            self._control.acknowledge()

    # -- stats, memory, close -----------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """A snapshot of every runtime metric now (device-side counts are read back now)."""
        self._gauges.refresh()
        return self.metrics.snapshot()

    def memory_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes held by tier ('device'/'host') and kind ('data'/'metadata')."""
        return self._gauges.memory_bytes()

    def close(self) -> None:
        """Publish a last snapshot and remove the segment (if the engine opened it)."""
        self._recal_deferred = None        # not launched: nothing will read it
        self.settle_recalibration()
        self._control.close()
        self.publisher.close(self._owned_segment)
