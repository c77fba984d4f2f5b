"""The host paths of a decode step queue their host-to-device copies behind the device's work.

A blocking copy to a GPU (``x.to("cuda")`` of a pageable host tensor, ``torch.tensor(...,
device="cuda")``) waits for everything queued on the stream first: a host sync in the middle of
a step, after which the rest of the step's launches run with the device idle. On the H200 the
audit's one such copy made every audited step 1.5-2x the median (docs/BENCHMARKS.md). Such a
call is found on the CPU by what it is made on: a host tensor, not page-locked, moved to a
device without ``non_blocking``, or a tensor made from host data with ``device=``
(``host_seal.to_device`` is the way: a pinned staging copy queued behind the work).
"""

from __future__ import annotations

import inspect
import os
import traceback

import pytest
import torch

from hi_sparse import batch_state, host_seal, probe, sequences
from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.host_seal import to_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RUNTIME = os.path.dirname(host_seal.__file__) + os.sep        # the runtime's modules (hi_sparse)

L, HQ, HKV, D = 2, 4, 2, 16


class BlockingCopies:
    """Records, while ``on``, the calls that would be a blocking host-to-device copy on a GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on, self.found = 0, []
        to, tensor = torch.Tensor.to, torch.tensor

        def spy_to(t, *args, **kwargs):
            moved = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
            blocking = not kwargs.get("non_blocking") and not (len(args) > 1 and args[1] is True)
            if self.on and moved and blocking and t.device.type == "cpu" and not t.is_pinned():
                self._note("Tensor.to")
            return to(t, *args, **kwargs)

        def spy_tensor(*args, **kwargs):
            if self.on and kwargs.get("device") is not None:
                self._note("torch.tensor(device=)")
            return tensor(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", spy_to)
        monkeypatch.setattr(torch, "tensor", spy_tensor)

    def _note(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if not stack[-1].filename.startswith(RUNTIME):
            return     # not the runtime's own call: a kernel's CPU reference (Triton runs on a GPU), torch
        self.found.append((what, [f"{f.filename.rsplit(os.sep, 1)[-1]}:{f.lineno} {f.name}" for f in stack[-3:]]))

    def watch(self, monkeypatch: pytest.MonkeyPatch, owner, name: str) -> list[int]:
        """``owner.name`` recorded while it runs; returns a list of its calls' count (one item)."""
        fn, calls = getattr(owner, name), [0]

        def watched(*args, **kwargs):
            calls[0] += 1
            self.on += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.on -= 1
        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        monkeypatch.setattr(owner, name, staticmethod(watched) if static else watched)
        return calls


def test_the_spy_finds_a_blocking_copy_and_passes_a_queued_one(monkeypatch):
    spy = BlockingCopies(monkeypatch)
    spy.on = 1
    to_device(torch.arange(3), torch.device("cpu"))            # the runtime's queued copy: passes
    assert spy.found == []
    made = {"torch": torch}       # a blocking copy and a tensor made there, as a runtime module's
    exec(compile("def move(t):\n    return t.to(t.device)\ndef make():\n    return torch.tensor([1], device='cpu')\n",
                 RUNTIME + "made_here.py", "exec"), made)
    made["move"](torch.arange(3))
    made["make"]()
    assert [what for what, _ in spy.found] == ["Tensor.to", "torch.tensor(device=)"]
    spy.found.clear()
    torch.tensor([1, 2], device="cpu")                        # called from here, not the runtime
    torch.arange(3).to(torch.device("cpu"))
    assert spy.found == []
    torch.arange(3).to(torch.float32)                         # a dtype, not a device
    torch.arange(3).to("cpu", non_blocking=True)
    assert spy.found == []


def test_audits_new_batches_and_moved_rows_make_no_blocking_copy(monkeypatch):
    """Decode steps that audit every step, build batches and move rows out of order, on the
    engine's own path: none of those parts makes a blocking copy (each is watched, and ran)."""
    spy = BlockingCopies(monkeypatch)
    eng = HiSparseEngine(HiSparseConfig(max_seq_len=256, cache_block_size=8, window_size=8, global_tokens=4,
                                        top_k=24, host_kv_bits=4, audit_every=1, telemetry=False,
                                        recalibrate_every=10 ** 6), L, HQ, HKV, D)
    calls = {"the audit": spy.watch(monkeypatch, eng, "_audit"),
             "a new batch": spy.watch(monkeypatch, batch_state.Batch, "__init__"),
             "rows moved": spy.watch(monkeypatch, sequences.SequenceTable, "_move_hot")}
    torch.manual_seed(0)
    ids = eng.add_sequences(3)
    K, V = torch.randn(2, L, 3, HKV, 40, D)
    Q = torch.randn(L, 3, HQ, 40, D)
    for i, batch in enumerate(([0, 1, 2], [2, 0])):    # the second is out of row order: its rows move
        sub = [ids[b] for b in batch]
        for t in range(20 * i, 20 * i + 20):
            eng.begin_step()
            for layer in range(L):
                at = (layer, batch, slice(None), slice(t, t + 1))
                eng.append(layer, sub, K[at].contiguous(), V[at].contiguous())
                eng.attend(layer, sub, Q[at].contiguous())
            eng.end_step()
    assert all(n[0] for n in calls.values()), calls
    assert eng.stats.anchor_lookups > 0                    # the audits counted
    assert spy.found == [], spy.found


def test_a_probes_thresholds_are_copied_behind_the_queued_work(monkeypatch):
    """What a probe's first fit writes into its gates in a step (probe.write_params)."""
    spy = BlockingCopies(monkeypatch)
    calls = spy.watch(monkeypatch, probe, "threshold_constants")
    got = probe.threshold_constants(torch.device("cpu"), 2.0, 0.1, 0.9)
    assert calls[0] == 1 and spy.found == []
    assert got.dtype == torch.float64 and got.tolist() == [2.0 ** 4 / 131072, probe.probe_threshold(1, 2.0, 0.1, 0.9),
                                                           0.9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_the_audits_read_and_count_and_a_new_batch_never_synchronize(monkeypatch):
    """torch's sync debug mode, set to raise, around what the audit queues before its one
    read-back (the batch's contexts read, the hits counted), a batch's making and a probe's
    thresholds: a blocking copy or any other host sync there fails the test."""
    from hi_sparse import prefill, recalibration

    # The debug mode is the process's, not a thread's: the recalibration runs in slices on this
    # thread here (no worker beside it to raise, or to restore a mode set here), and the mode is
    # off again after the test whatever happens.
    def strict(owner, name):
        fn = getattr(owner, name)
        calls = [0]

        def checked(*args, **kwargs):
            calls[0] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monkeypatch.setattr(owner, name, checked)
        return calls

    calls = [strict(prefill.ContextReader, "read_batch"), strict(recalibration, "audit_hits"),
             strict(batch_state.Batch, "__init__"), strict(probe, "threshold_constants")]
    eng = HiSparseEngine(HiSparseConfig(max_seq_len=512, cache_block_size=16, window_size=16, global_tokens=4,
                                        top_k=48, host_kv_bits=4, audit_every=1, telemetry=False,
                                        recalibrate_every=10 ** 6), L, HQ, HKV, D, device="cuda")
    eng._recalibrator.threaded = False
    torch.manual_seed(0)
    ids = eng.add_sequences(2)
    K, V = torch.randn(2, L, 2, HKV, 120, D, device="cuda")
    Q = torch.randn(L, 2, HQ, 120, D, device="cuda")
    try:
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, K[layer, :, :, :100], V[layer, :, :, :100])
            eng.attend(layer, ids, Q[layer, :, :, :100])
        eng.end_step()
        for t in range(100, 120):
            eng.begin_step()
            for layer in range(L):
                eng.append(layer, ids, K[layer, :, :, t:t + 1], V[layer, :, :, t:t + 1])
                eng.attend(layer, ids, Q[layer, :, :, t:t + 1])
            eng.end_step()
        probe.threshold_constants(torch.device("cuda"), 2.0, 0.1, 0.9)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(n[0] for n in calls), calls
    assert eng.stats.anchor_lookups > 0
