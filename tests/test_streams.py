"""The runtime's side streams (streams.own_stream): one CUDA stream per device and role, never one
that torch's stream pool hands to anyone else (a pooled stream comes round again after 32)."""

import threading

import pytest
import torch

from hi_sparse.streams import own_stream

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
ROLES = ("capture", "capture ahead", "recalibration", "seal 1", "seal 2", "seal 3")


@pytest.mark.gpu
@needs_cuda
def test_each_role_has_a_stream_no_pooled_stream_is():
    dev = torch.device("cuda", 0)
    mine = {role: own_stream(dev, role) for role in ROLES}
    assert all(own_stream(dev, role) is s for role, s in mine.items())      # made once
    assert own_stream(0, "capture") is mine["capture"]
    handles = {s.cuda_stream for s in mine.values()}
    assert len(handles) == len(ROLES) and 0 not in handles
    pooled = {torch.cuda.Stream(dev).cuda_stream for _ in range(3 * 32)}    # every pool stream, round robin
    assert len(pooled) >= 32 and not handles & pooled
    assert all(s.device == dev for s in mine.values())


@pytest.mark.gpu
@needs_cuda
def test_a_capture_on_its_stream_keeps_another_threads_work_out():
    """What broke a seal capture on the H200: another thread's work queued meanwhile on a stream
    the capture had forked onto. On streams of their own the capture holds only its work, and
    the other thread's work runs (once, now)."""
    dev = torch.device("cuda", 0)
    side, cap, other = own_stream(dev, "seal 1"), own_stream(dev, "capture"), own_stream(dev, "recalibration")
    x, counter = torch.zeros(4, device=dev), torch.zeros(1, device=dev)
    stop, ran = threading.Event(), []

    def worker():
        with torch.cuda.stream(other):
            while not stop.is_set():
                counter.add_(1)
                ran.append(1)
        other.synchronize()

    graph = torch.cuda.CUDAGraph()
    cap.wait_stream(torch.cuda.current_stream(dev))
    thread = threading.Thread(target=worker)
    thread.start()
    with torch.cuda.stream(cap):
        graph.capture_begin(capture_error_mode="thread_local")
        side.wait_stream(cap)
        with torch.cuda.stream(side):
            x.add_(1)
        cap.wait_stream(side)
        x.mul_(2)
        graph.capture_end()
    stop.set()
    thread.join()
    torch.cuda.current_stream(dev).wait_stream(cap)
    done = counter.item()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [6.0] * 4            # (0 + 1) * 2, then (2 + 1) * 2: nothing else replayed
    assert counter.item() == done == len(ran)


@pytest.mark.gpu
@needs_cuda
def test_work_first_in_line_runs_at_high_priority_in_the_current_streams_order():
    from hi_sparse.streams import first_in_line
    dev = torch.device("cuda", 0)
    assert own_stream(dev, "steps", high=True).priority < own_stream(dev, "recalibration").priority
    x = torch.zeros(1 << 24, device=dev)
    for _ in range(3):                 # long kernels: out of order, the result would differ
        x.add_(1)
        with first_in_line(dev):
            assert torch.cuda.current_stream(dev) == own_stream(dev, "steps", high=True)
            x.mul_(3)
        x.sub_(2)
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)
    assert torch.unique(x).tolist() == [13.0]           # 0 -> 1 -> 4 -> 13


@pytest.mark.gpu
@needs_cuda
def test_a_graph_uploaded_on_another_thread_replays_what_it_captured():
    """streams.upload, as a capture ahead does on its thread: the driver takes the upload, and the
    graph's first replay on another stream computes what it captured."""
    from hi_sparse.batch_step import capture
    from hi_sparse.streams import upload

    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    out: dict = {}

    def ahead():
        with torch.cuda.device(0):
            graph, y = capture(lambda: (x * 2 + 1).sum(), torch.cuda.graph_pool_handle(), begun=lambda: None)
            out["graph"], out["y"] = graph, y
            out["again"] = upload(graph, own_stream(x.device, "capture ahead"))   # a second upload: fine too

    worker = threading.Thread(target=ahead)
    worker.start()
    worker.join()
    assert out["again"] is True
    x.fill_(1.0)
    out["graph"].replay()
    assert out["y"].item() == 3.0 * 1024
    assert upload(torch.cuda.CUDAGraph(), own_stream(x.device, "capture")) is False     # nothing captured
