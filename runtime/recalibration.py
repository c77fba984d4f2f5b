"""The audit and recalibration: exact attention as the ground truth for anchors and the probe.

The audit (:func:`audit_hits`): exact attention of one query head over the whole visible
context; of the true top-m tokens, how many the selection held gives anchor hits / lookups.
Measured, not estimated.

When to recalibrate (:class:`RecalibrationController`, pure logic): on schedule (tokens since
the last one, and once at first when sparsity starts), on request (control file or API), or on
drift (audited hit rate over the last ``drift_window`` audits below ``drift_floor``).

How (:func:`score_tokens`, :func:`training_set`, :func:`pick_anchors`): recent decode queries
(:func:`remember_queries`) attend exactly over the context outside the window; the mass each
token receives, weighted to favour the newest queries, ranks the anchors and gives the probe's
distillation targets. :class:`Recalibrator` runs both against an engine's layers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from easymats.catalogue import RECALIBRATION_REASONS
from hi_sparse.kernels import gather_layers
from hi_sparse.kernels.recent import push_recent

from .host_seal import to_device
from .probe import FIT_STEPS, fit_iterations, small_ops_on_cpu
from .recal_job import RecalibrationJob
from .row_bank import RowBank
from .trace import phase

if TYPE_CHECKING:          # prefill imports this module (remember_queries)
    from .layers import KVShape, LayerRows
    from .prefill import ContextReader
    from .sequences import Sequence

RECENCY_DECAY = 0.5  # weight per step of query age: after a topic shift the new topic wins fast
NEGATIVES = 512      # probe training rows per sequence and KV head besides its heaviest tokens
FIT_ROWS = 16384     # a probe's training rows of one recalibration, at most about
FIT_SLICE = 1 << 20   # elements of the hidden activations one fit iteration of a CPU's probes makes, at most about
SCORE_KEYS = 1 << 27  # elements of the keys one scoring read holds (fp32: 512 MB), at most about
REASONS = RECALIBRATION_REASONS


def attention_probs(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact softmax attention weights. q (..., D), keys (L, D) (or (H, L, D) for q (H, Q, D): per
    head), visible (L,) bool -> (..., L) fp32."""
    s = (q.float() @ keys.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1)


def audit_hits(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, selected: torch.Tensor,
               top_m: int, scale: float, measure: str = "top_m") -> torch.Tensor:
    """(lookups, hits) of B queries q (B, D) against their selections ``selected`` (B, K), -1
    padded: (B, 2) fp32 on q's device, no host sync; keys (B, L, D), visible (B, L) bool.
    "top_m": the true top-m tokens and how many were selected; "mass": one lookup, and the share
    of the query's exact attention that fell on selected tokens. A query with nothing visible
    counts neither."""
    n_visible = visible.sum(1)
    seen = n_visible > 0
    p = attention_probs(q[:, None], keys, visible[:, None], scale)[:, 0].nan_to_num(0.0)  # (B, L)
    held = selected >= 0
    if measure == "mass":
        kept = (p.gather(1, selected.clamp_min(0)) * held).sum(1).clamp(max=1.0)
        return torch.stack([seen.float(), torch.where(seen, kept, 0.0)], 1)
    m = n_visible.clamp(max=top_m)                                                      # (B,)
    # visible tokens rank above the hidden ones even where their weight underflows to 0
    top = p.masked_fill(~visible, -1.0).topk(min(top_m, p.shape[1]), dim=1).indices   # (B, M)
    ranked = torch.arange(top.shape[1], device=p.device)[None] < m[:, None]
    hit = ((top[:, :, None] == selected[:, None, :]) & held[:, None, :]).any(2) & ranked
    return torch.stack([m.float(), hit.sum(1).float()], 1)


def attention_mass(queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean attention weight each token received: queries (Q, D), keys (L, D),
    weights (Q,) or None (uniform) -> (L,) fp32; or per head: queries (H, Q, D), keys (H, L, D),
    weights (Q,) or (H, Q) -> (H, L)."""
    p = attention_probs(queries, keys, visible, scale)
    if weights is None:
        return p.mean(-2)
    w = weights.float().to(p.device)
    return (p * w[..., None]).sum(-2) / w.sum(-1, keepdim=True)


def remember_queries(bank: RowBank, rows: slice, q: torch.Tensor) -> None:
    """Keep the last R (the bank's width) of each sequence's queries q (B, T, Hq, D), appended to
    those its rows hold (recalibration re-scores anchors with them)."""
    held = bank.t["queries"][rows]
    R = held.shape[1]
    if q.shape[1] == 1:                # a decode step's query: one launch on a GPU
        push_recent(held, q[:, 0])
        return
    held.copy_(torch.cat([held, q[:, -R:].float()], 1)[:, -R:])


def distillation_target(mass: torch.Tensor, n_visible: int | torch.Tensor, gain: float = 100.0) -> torch.Tensor:
    """Probe targets from attention mass: 0 at or below the uniform share 1/n, 1 at ``gain`` times
    it, log-linear between (attention mass spans orders of magnitude). mass (..., L) -> (..., L);
    n_visible an int or a 0-dim tensor on mass's device (no host sync)."""
    n = n_visible.clamp_min(1) if isinstance(n_visible, torch.Tensor) else max(n_visible, 1)
    ratio = (mass * n).clamp_min(1e-30)
    return (ratio.log() / math.log(gain)).clamp(0.0, 1.0)


class RecalibrationController:
    """Pure decision logic; the engine performs the recalibration and calls :meth:`done`.

    Drift is judged on the audits since the last recalibration. When a drift recalibration does
    not lift the rate above the floor (anchors cannot help: the workload has none), the next one
    waits twice as many audits (up to 64 x ``drift_window``), so drift never becomes a storm.
    """

    MAX_BACKOFF = 64

    def __init__(self, every_tokens: int, drift_floor: float, drift_window: int) -> None:
        self.every = every_tokens
        self.floor = drift_floor
        self.window = drift_window
        self.tokens_since = 0
        self.calibrated = False
        self.requested: str | None = None
        self.backoff = 1
        self.history: deque[tuple[float, float]] = deque(maxlen=drift_window * self.MAX_BACKOFF)

    def on_tokens(self, n: int) -> None:
        self.tokens_since += n

    def on_audit(self, lookups: float, hits: float) -> None:
        if lookups:
            self.history.append((lookups, hits))
            need = self.window * self.backoff
            rate = self.audited_rate(need)
            if len(self.history) >= need and rate is not None and rate >= self.floor:
                self.backoff = 1  # healthy over a whole judged window: judge promptly again

    def request(self, reason: str = "request") -> None:
        self.requested = reason

    def audited_rate(self, last: int | None = None) -> float | None:
        """Hits / lookups over the last ``last`` audits (all since the last recalibration if None)."""
        hist = list(self.history)[-last:] if last else self.history
        look = sum(lk for lk, _ in hist)
        return None if not look else sum(h for _, h in hist) / look

    def due(self, ready: bool) -> str | None:
        """The reason to recalibrate now, or None. ``ready``: there is context and queries to use."""
        if not ready:
            return None
        if self.requested:
            return self.requested
        need = self.window * self.backoff
        rate = self.audited_rate(need)
        if len(self.history) >= need and rate is not None and rate < self.floor:
            return "drift"
        if not self.calibrated or self.tokens_since >= self.every:
            return "schedule"
        return None

    def start(self, reason: str) -> None:
        """A recalibration for ``reason`` begins: the request it answers is consumed (one made
        while it runs in the background waits for the next)."""
        if self.requested == reason:
            self.requested = None

    def done(self, reason: str | None = None) -> None:
        """A recalibration took effect (its anchors and probes are in use)."""
        if reason == "drift":
            self.backoff = min(self.MAX_BACKOFF, self.backoff * 2)
        self.tokens_since = 0
        self.calibrated = True
        self.history.clear()  # judge drift on audits of the new anchors only


def score_tokens(queries: torch.Tensor, kept: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                 lengths: torch.Tensor, window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention mass per token and KV head from recent queries, for B sequences at once.

    queries (B, R, Hkv, G, D) oldest first, of which the last kept[b] are sequence b's (the rest
    weigh nothing); keys (B, Hkv, n, D); visible (B, n) bool; kept, lengths (B,) int64 on keys'
    device. Returns (mass (B, Hkv, n), zero but outside the window, targets (B, Hkv, n) in
    [0, 1], outside (B, n)). No host sync: everything stays on keys' device.
    """
    B, R, H, G, D = queries.shape
    n, dev = keys.shape[2], keys.device
    outside = visible & (torch.arange(n, device=dev)[None] < (lengths - window)[:, None])
    age = torch.arange(R - 1, -1, -1, device=dev)
    valid = age[None] < kept[:, None]                                                    # (B, R)
    w = (RECENCY_DECAY ** age.float())[None] * valid
    q = torch.where(valid[:, :, None, None, None], queries, 0.0)       # rows not kept: stale, weightless
    # (sequence, KV head) pairs in batched products, as many at once as keep the scores under
    # 2**26 elements (one at a time at 1M tokens)
    qh = q.permute(0, 2, 1, 3, 4).reshape(B * H, R * G, D)
    wh = w.repeat_interleave(G, dim=1).repeat_interleave(H, dim=0)                       # (B*H, R*G)
    vh = visible.repeat_interleave(H, dim=0)[:, None]                                    # (B*H, 1, n)
    kh = keys.reshape(B * H, n, D)
    per = max(1, (1 << 26) // max(1, R * G * n))
    mass = torch.cat([attention_mass(qh[r:r + per], kh[r:r + per], vh[r:r + per], scale, wh[r:r + per])
                      for r in range(0, B * H, per)]).view(B, H, n)
    mass = torch.where(outside[:, None], mass, 0.0)
    return mass, distillation_target(mass, visible.sum(1)[:, None, None]), outside


def training_set(keys: torch.Tensor, mass: torch.Tensor, target: torch.Tensor, outside: torch.Tensor,
                 topk: int, negatives: int, generator: torch.Generator,
                 n_outside: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe training rows: per head the ``topk`` heaviest tokens and a sample of the rest.

    Returns (x (N, D), y (N,)): on the CPU, or, when the caller knows how many tokens are outside
    the window (``n_outside``: no holes; ``generator`` on keys' device), on that device without a
    host sync (the sample: the outside tokens of the largest random keys).
    """
    if n_outside is not None:
        H, n, D = keys.shape
        m, k = min(topk, n_outside), min(negatives, n_outside)
        r = torch.rand(H, n, generator=generator, device=keys.device).masked_fill_(~outside, -1.0)
        idx = torch.cat([mass.topk(m, dim=1).indices, r.topk(k, dim=1).indices], 1)       # (H, m + k)
        x = keys.gather(1, idx[..., None].expand(H, m + k, D)).reshape(-1, D)
        return x, target.gather(1, idx).reshape(-1)
    cand = torch.nonzero(outside).squeeze(1).cpu()
    m = min(topk, cand.numel())
    top = mass.topk(m, dim=1).indices
    xs, ys = [], []
    for h in range(keys.shape[0]):
        neg = cand[torch.randperm(cand.numel(), generator=generator)[:negatives]].to(keys.device)
        idx = torch.cat([top[h], neg])
        xs.append(keys[h, idx])
        ys.append(target[h, idx])
    return torch.cat(xs).cpu(), torch.cat(ys).cpu()


def pick_anchors(mass: torch.Tensor, target: torch.Tensor, outside: torch.Tensor,
                 slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``slots`` heaviest tokens per head outside the window, -1 padded where fewer are
    outside: (positions, scores), each (..., Hkv, slots) of mass, target (..., Hkv, n) and
    outside (..., n). Scores are their targets, so a probe-picked token must beat them. No host
    sync."""
    k = min(slots, mass.shape[-1])
    val, top = mass.masked_fill(~outside[..., None, :], -1.0).topk(k, dim=-1)
    held = val >= 0                                     # outside the window: mass 0 or more
    pos = torch.where(held, top, -1)
    score = torch.where(held, target.gather(-1, top), -1.0)
    return (torch.nn.functional.pad(pos, (0, slots - k), value=-1),
            torch.nn.functional.pad(score, (0, slots - k), value=-1.0))


def _fit_groups(fits: list[tuple[LayerRows, tuple[torch.Tensor, torch.Tensor]]]) -> list[list]:
    """The probes of one device's layers (with their training sets) in the groups fitted together:
    all at once on a GPU (one launch an op for every layer); on a CPU as many layers at once as
    keep an op under FIT_SLICE elements, so that an iteration of one group is a slice a step can
    take (SmolLM2's 30 layers at once: ~70 ms an iteration, against a ~90 ms step)."""
    if fits[0][0].device.type != "cpu":
        return [fits]
    groups: list[list] = [[]]
    size = 0
    for layer, data in fits:
        n = len(data[1]) * layer.probe.fc1.out_features
        if groups[-1] and size + n > FIT_SLICE:
            groups.append([])
            size = 0
        groups[-1].append((layer, data))
        size += n
    return groups


def _fit_group_count(fits: list[tuple[LayerRows, tuple[torch.Tensor, torch.Tensor]]], scale: float) -> int:
    """How many groups :func:`_fit_groups` will make of one device's layers once ``scale`` times as
    many have their training sets as ``fits`` has (exact at 1)."""
    groups = len(_fit_groups(fits))
    if scale == 1 or fits[0][0].device.type != "cpu":
        return groups
    size = sum(len(data[1]) * layer.probe.fc1.out_features for layer, data in fits)
    return max(groups, math.ceil(size * scale / FIT_SLICE))


class Audit(NamedTuple):
    """One audited (sequence, layer, query head): lookups and hits as ``audit_measure`` counts them
    (true top-m tokens and those selected, or one query and the attention share it kept)."""
    step: int
    layer: int
    head: int
    lookups: float
    hits: float


class Recalibrator:
    """Audits selections and recalibrates anchors and probes on an engine's layers."""

    def __init__(self, cfg, shape: KVShape, layers: list[LayerRows], reader: ContextReader) -> None:
        self.cfg, self.shape, self.layers, self.reader = cfg, shape, layers, reader
        self._fits = 0
        self.threaded: bool | None = None    # a background job's worker thread: None on a GPU (tests: True)

    def audit(self, layer: LayerRows, seqs: list[Sequence], q: torch.Tensor, head: int) -> list[tuple[float, float]]:
        """(lookups, hits) per sequence of query head ``head`` of q (B, Hq, D) against the
        sequence's last selection at this layer (``audit_measure``: top-m tokens or attention
        mass): the batch's contexts read at once and one read-back of the counts."""
        kv_head = head // self.shape.group_size
        n = max(s.lengths[layer.index] for s in seqs)
        keys = self.reader.read_batch(seqs, layer, n, kv_head)[:, 0]                      # (B, n, D)
        selected = self._selected(layer, seqs, kv_head)
        counts = audit_hits(q[:, head], keys, self.reader.visible_batch(seqs, layer, n), selected,
                            self.cfg.audit_top_m, self.shape.scale, self.cfg.audit_measure)
        return [(lookups, hits) for lookups, hits in counts.tolist()]

    def _selected(self, layer: LayerRows, seqs: list[Sequence], kv_head: int) -> torch.Tensor:
        """(B, K) the sequences' last selections at ``layer`` and ``kv_head``, -1 padded: a view of
        the step's (B * Hkv, K) where they were its batch in order, else one row each, padded."""
        H, got = self.shape.num_kv_heads, [s.last_selection[layer.index] for s in seqs]
        step = got[0][0]
        if step.shape[0] == len(seqs) * H and all(g[0] is step and g[1] == b * H for b, g in enumerate(got)):
            return step.view(len(seqs), H, -1)[:, kv_head]
        picked = [s.selection(layer.index)[kv_head] for s in seqs]
        return torch.nn.utils.rnn.pad_sequence(picked, batch_first=True, padding_value=-1)

    def start(self, seqs: list[Sequence], reason: str, background: bool) -> RecalibrationJob:
        """Re-score anchors from the attention mass recent queries gave, and refit each probe
        (the probes of the layers on one device in one batched fit), into a job whose
        :meth:`RecalibrationJob.commit` writes them. ``background``: the job is committed later;
        on a GPU a worker thread queues its work on a side stream after what the device has
        queued so far, from copies of what later steps change (recent queries, visibility, block
        tables, float tails: made now), and the call returns without waiting (recal_job.py); on a
        CPU the engine runs its work in slices between decode steps (RecalibrationJob.advance),
        from the same copies. Without ``background`` the work is done now."""
        job = RecalibrationJob(reason, background)
        if self.cfg.global_tokens == 0:
            return job  # nothing is pinned, so there is nothing to re-score or fit
        fit = self._fit_sequences(seqs)
        thread = background and (any(layer.device.type == "cuda" for layer in self.layers) if self.threaded is None
                                 else self.threaded)
        work = [(layer, inputs) for layer, inputs in zip(self.layers, self._inputs(seqs, tails=background))
                if inputs is not None]
        job.inputs.extend(inputs for _, inputs in work)      # made on the current stream: kept until the commit
        # the side streams wait for the copies just queued; the work comes after them
        streams = {layer.device: job.stream_for(layer.device) for layer, _ in work} if background else {}
        job.run(self._work(work, fit, job, streams), "thread" if thread else "slices" if background else "now")
        return job

    def _work(self, work: list, fit: set[int], job: RecalibrationJob, streams: dict) -> Iterator[int]:
        """Each layer's contexts read and scored into ``job``, then the probes of each device fitted
        together, on the side streams ``streams`` (the current ones without): in slices, a layer's
        scoring or a fit's iteration each, with nothing of it (one thread, a stream) set between
        them, so a CPU's decode steps may run between two (RecalibrationJob.advance)."""
        fits: dict[torch.device, list] = {}
        per = FIT_STEPS - 1     # slices of a group's fit: its last iteration runs in the next group's first
        for n, (layer, inputs) in enumerate(work, 1):
            stream = streams.get(layer.device)
            with layer.on_device(), small_ops_on_cpu(layer.device), job.on(stream), phase("recalibrate.score"):
                data = self._layer(layer, inputs, fit, job)
            if data is not None:
                fits.setdefault(layer.device, []).append((layer, data))
            job.reading = n < len(work)     # the fit reads no host blocks (RecalibrationJob.release)
            # the slices left (RecalibrationJob.advance paces them), the fit's groups estimated
            yield len(work) - n + per * sum(_fit_group_count(f, len(work) / n) for f in fits.values()) + 1
        job.reading = False
        every = [g for device_fits in fits.values() for g in _fit_groups(device_fits)]
        for g, group in enumerate(every):
            device = group[0][0].device
            probes = [layer.probe for layer, _ in group]
            training = fit_iterations(probes, [data for _, data in group], FIT_STEPS)
            left = (len(every) - g) * per + 1
            while True:
                with (group[0][0].on_device(), small_ops_on_cpu(device), job.on(streams.get(device)),
                      phase("recalibrate.fit")):
                    try:
                        next(training)
                    except StopIteration as end:
                        job.fits.append((probes, end.value[0]))
                        break
                left -= 1
                yield left

    def _fit_sequences(self, seqs: list[Sequence]) -> set[int]:
        """The ids of the sequences whose tokens train the probes: all where they give up to
        FIT_ROWS rows a layer, else as many as do, spread evenly over the batch (shifted each
        recalibration). A probe learns what a key looks like, not a sequence: 24 sequences of 8
        heads gave 104K rows a layer, and the fit of 32 layers took ~1 s of the H200."""
        each = self.shape.num_kv_heads * (self.cfg.recalibrate_topk + NEGATIVES)
        k = max(1, FIT_ROWS // each)
        if len(seqs) <= k:
            return {s.seq_id for s in seqs}
        self._fits += 1
        stride = len(seqs) / k
        return {seqs[int(j * stride) + self._fits % int(stride)].seq_id for j in range(k)}

    def _inputs(self, seqs: list[Sequence], tails: bool = False) -> list[tuple | None]:
        """What each layer's scoring reads besides the host pool, of the sequences with context and
        queries there: (those sequences, their recent queries (B, R, Hkv, G, D), queries kept (B,),
        visible (B, n) bool (or None: the worker makes it from the first visible positions and
        lengths, which then follow), lengths (B,), tokens outside the window per sequence or None
        with holes, their lengths, the reads' block tables (ContextReader.read_meta), with
        ``tails`` their float tails read now (else None), first visible positions (B,)); copies,
        so that later steps may change the rows; None for a layer where no sequence has both.
        Layers where the sequences stand alike (a step's layers do) share what is made: the block
        tables, and one gather of all their recent queries and one of all their float tails."""
        cfg, alike, todo = self.cfg, {}, {}
        for layer in self.layers:
            i = layer.index
            todo[i] = [s for s in seqs if s.queries_kept[i] and s.lengths[i] - s.first_token > cfg.window_size]
            if todo[i]:
                like = (layer.device, tuple((s.row, s.queries_kept[i], s.lengths[i], s.first_token) for s in todo[i]))
                alike.setdefault(like, []).append(layer)
        made: dict[int, tuple] = {}
        tables: dict = {}       # block tables by sequence id: the same at every layer
        for (_, per_seq), group in alike.items():
            with group[0].on_device():
                made.update(self._alike(group, todo[group[0].index], per_seq, tables, tails))
        return [made.get(layer.index) for layer in self.layers]

    def _alike(self, group: list[LayerRows], todo: list[Sequence], per_seq: tuple, tables: dict, tails: bool
               ) -> dict[int, tuple]:
        """:meth:`_inputs` of layers on one device where the sequences ``todo`` stand alike
        (``per_seq``: their bank rows, queries kept, lengths and first visible positions), by layer."""
        cfg, shape, dev, i = self.cfg, self.shape, group[0].device, group[0].index
        meta = self.reader.read_meta(todo, group[0], tables)
        holes = [self.reader.storage.has_holes(s) for s in todo]
        rows, kept, lengths, first = to_device(torch.tensor(per_seq), dev).unbind(1)
        queries = gather_layers([layer.bank.t["queries"] for layer in group], rows)       # (L, B, R, Hq, D)
        snaps = self.reader.read_tails(meta, group) if tails else None
        # without holes every token from the first visible one to the window is outside it
        n_out = [None if h else s.lengths[i] - cfg.window_size - s.first_token for s, h in zip(todo, holes)]
        n_all = [s.lengths[i] for s in todo]
        out = {}
        for j, layer in enumerate(group):
            # a worker makes the visibility of contexts without holes (no bank read) from the copies
            visible = self.reader.visible_batch(todo, layer, max(n_all)) if any(holes) or not tails else None
            self.reader.host.prepare(layer.index, dev)   # what a read on the device makes, made here
            q = queries[j].view(len(todo), -1, shape.num_kv_heads, shape.group_size, shape.head_dim)
            out[layer.index] = (todo, q, kept, visible, lengths, n_out, n_all, meta,
                                None if snaps is None else snaps[j], first)
        return out

    def _layer(self, layer: LayerRows, inputs: tuple, fit: set[int], job: "RecalibrationJob"
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's anchors re-scored, on its device, into the job, the sequences' contexts
        read and scored together (as many at once as keep the keys under SCORE_KEYS elements);
        returns its probe's training set (keys, targets) from the sequences ``fit`` names, or
        None when it has none."""
        cfg, shape, i = self.cfg, self.shape, layer.index
        seqs, queries, kept, visible, lengths, n_out, n_all, meta, tails, first = inputs
        if visible is None:
            at = torch.arange(max(n_all), device=lengths.device)
            visible = (at >= first[:, None]) & (at < lengths[:, None])
        xs, ys = [], []
        # on a GPU the sample is drawn there and nothing waits for the device (a prefill's first
        # recalibration of 32 layers took ~10 host syncs per layer); the CPU keeps its own stream
        # of random numbers
        g = torch.Generator(device=layer.device).manual_seed(cfg.seed + i)
        H = shape.num_kv_heads
        per = max(1, SCORE_KEYS // (H * max(n_all) * shape.head_dim))
        for lo in range(0, len(seqs), per):
            part = slice(lo, lo + per)
            n = max(n_all[part])
            keys = self.reader.read_batch(seqs[part], layer, n, meta=meta[part],
                                          tails=None if tails is None else tails[part])
            mass, target, outside = score_tokens(queries[part], kept[part], keys, visible[part, :n], lengths[part],
                                                 cfg.window_size, shape.scale)
            pos, score = pick_anchors(mass, target, outside, cfg.global_tokens)
            # holes may leave nothing outside the window: that sequence's anchors stay
            held = [b for b, m in enumerate(n_out[part]) if m is not None or bool(outside[b].any())]
            if len(held) < len(pos):
                at = to_device(torch.tensor(held, dtype=torch.int64), pos.device)
                pos, score = pos[at], score[at]
            bank = layer.bank.t          # in the bank's dtypes here, on the side stream: the commit only writes
            job.anchors.append(([seqs[lo + b] for b in held], i, pos.to(bank["anchors"].dtype),
                                score.to(bank["anchor_p"].dtype)))
            for b in held:
                s, m = seqs[lo + b], n_out[lo + b]
                if s.seq_id in fit:
                    x, y = training_set(keys[b], mass[b], target[b], outside[b], cfg.recalibrate_topk, NEGATIVES, g,
                                        m if layer.device.type == "cuda" else None)
                    xs.append(x)
                    ys.append(y)
        return (torch.cat(xs), torch.cat(ys)) if xs else None
