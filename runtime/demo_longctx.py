"""The demo's long-context decode driver: documents with planted structure, on a schedule.

Built from :mod:`hi_sparse.workloads` (keys with planted topic anchors and needles, queries that
attend to them) and run straight on a :class:`HiSparseEngine`, so the numbers it produces are
the engine's own: the audit measures the anchor hit rate by exact attention, never by fiat.

Timeline of one document, as fractions of the run (wall clock, so a 20 s and a 60 s demo tell
the same story; a run longer than a minute repeats it every minute with a new document, and the
old document's blocks recycle):

    0          prefill a document about topic A (anchors + needles), decode topic-A queries
    0.20       the request is preempted and resumed within the recycle grace (blocks reclaimed)
    0.35       topic shift: a chunk about topic B arrives and the queries follow it; the pinned
               topic-A anchors stop being what attention needs, the audited hit rate drops, the
               drift check recalibrates and the hit rate recovers
    ...        the context keeps growing past the bounded host pool: streaming mode evicts the
               least important blocks
"""

from __future__ import annotations

import time

import torch

from .config import HiSparseConfig
from .engine import HiSparseEngine
from .workloads import PlantedWorkload, run_decode, run_prefill

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 32
PROMPT_TOKENS = 2048
SHIFT_TOKENS = 512
NEEDLES = (0, 1, 2)
CYCLE_S = 60.0  # the timeline repeats with a new document every minute of a longer run


def longctx_config(name: str) -> HiSparseConfig:
    bs = 32
    return HiSparseConfig(
        max_seq_len=32768, cache_block_size=bs, window_size=64, global_tokens=16, top_k=256,
        device_buffer_tokens=384, host_kv_bits="budget", quant_error_budget=0.02,
        # planted needles: the audit counts the true top-m tokens (a planted topic shift moves
        # them; the attention mass the selection keeps stays high on planted keys)
        recalibrate_every=1 << 20, recalibrate_topk=16, audit_every=2, audit_top_m=8, audit_measure="top_m",
        drift_floor=0.6, drift_window=6, prefetch_blocks=2, streaming=True,
        # room for the prompt and the shift chunk, little more: decode growth then evicts
        host_pool_blocks=(PROMPT_TOKENS + SHIFT_TOKENS) // bs + 2, name=name)


class DocumentTimeline:
    """The timeline above, for a workload that says how to start a document (``_new_document``),
    shift its topic (``_shift``) and take one decode step (``_step``), and which engine sequences
    hold it (``_seq_ids``). :meth:`run_for` advances it; it repeats every ``cycle_s`` seconds
    with a new document (the old one is freed, so its blocks recycle)."""

    PREEMPT_AT, SHIFT_AT = 0.20, 0.35
    engine: HiSparseEngine
    cycle_s: float
    start: float
    preempted: bool
    shifted: bool

    def _new_document(self) -> None:
        raise NotImplementedError

    def _shift(self) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _seq_ids(self) -> list[int]:
        raise NotImplementedError

    def restart_clock(self) -> None:
        """Start the timeline now (set-up may take long on a busy machine)."""
        self.start = time.monotonic()

    def _phase(self) -> float:
        """Position in the current cycle, 0..1; starts a new document when a cycle is over."""
        phase = (time.monotonic() - self.start) / self.cycle_s
        full = self.engine.seq_len(self._seq_ids()[0]) + 1 >= self.engine.cfg.max_seq_len
        if phase >= 1.0 or full:
            self.start = time.monotonic()
            self._new_document()
            phase = 0.0
        return phase

    def run_for(self, seconds: float) -> None:
        """Decode steps (and the timeline's events) for about ``seconds``, and at least one: on a
        slow machine one generate request can take a demo's whole slice, and the reader must
        still be seen decoding."""
        end = time.monotonic() + seconds
        first = True
        while first or time.monotonic() < end:
            first = False
            phase = self._phase()
            if not self.preempted and phase >= self.PREEMPT_AT:
                self.preempted = True
                # A scheduler preempts the request and resumes it at once: its blocks were only
                # pending recycle, so they are reclaimed instead of re-prefilled.
                ids = self._seq_ids()
                self.engine.free_sequences(ids)
                if not self.engine.resume_sequence(ids[0]):
                    raise RuntimeError("bug: a sequence freed just now could not be resumed")
            if not self.shifted and phase >= self.SHIFT_AT:
                self.shifted = True
                self._shift()
            self._step()


class LongContextWorkload(DocumentTimeline):
    """Drives one engine with planted documents through the timeline above."""

    def __init__(self, device: torch.device, seed: int, duration_s: float, name: str):
        self.engine = HiSparseEngine(longctx_config(name), num_layers=LAYERS, num_q_heads=Q_HEADS,
                                     num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, device=device,
                                     model_name="planted-longctx")
        self.work = PlantedWorkload(KV_HEADS, Q_HEADS, HEAD_DIM, seed=seed)
        self.device = device
        self.cycle_s = min(duration_s, CYCLE_S)
        self.steps = 0
        self.documents = 0
        self.seq: list[int] = []
        self.start = time.monotonic()
        self._new_document()

    def _seq_ids(self) -> list[int]:
        return self.seq

    def _new_document(self) -> None:
        if self.seq:
            self.engine.free_sequences(self.seq)
        self.documents += 1
        self.topic = f"A{self.documents}"
        self.shift_topic = f"B{self.documents}"
        self.preempted = self.shifted = False
        self.seq = self.engine.add_sequences(1)
        seg = self.work.segment(PROMPT_TOKENS, topic=self.topic, anchors=16, needles=NEEDLES,
                                margin=self.engine.cfg.window_size)
        self._prefill(seg.k, seg.v)

    def _prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        run_prefill(self.engine, self.seq, k[None].to(self.device), v[None].to(self.device))

    def _step(self) -> None:
        w = self.work
        # Mostly queries about the current topic, now and then one that looks for a needle.
        if self.steps % 8 == 7:
            q = w.needle_query(NEEDLES[(self.steps // 8) % len(NEEDLES)])
        else:
            q = w.topic_query(self.topic)
        k, v = w.noise(1)
        run_decode(self.engine, self.seq, q[None, :, None].to(self.device),
                   k[None].to(self.device), v[None].to(self.device))
        self.steps += 1

    def _shift(self) -> None:
        self.topic = self.shift_topic
        seg = self.work.segment(SHIFT_TOKENS, topic=self.topic, anchors=16,
                                margin=self.engine.cfg.window_size)
        self._prefill(seg.k, seg.v)

    def describe(self) -> str:
        st = self.engine.stats
        rate = st.anchor_hits / st.anchor_lookups if st.anchor_lookups else float("nan")
        return (f"long-context driver: {self.documents} document(s), {self.steps} decode steps, context "
                f"{self.engine.seq_len(self.seq[0])} tokens, anchor hit rate {rate:.0%}, "
                f"recalibrations {dict(st.recalibrations)}, {st.block_evictions} blocks evicted")

    def close(self) -> None:
        self.engine.close()
