"""End to end: HiSparse against dense SDPA on a Llama-3-8B-shaped model (issue 9).

    python benchmarks/e2e_h200.py --contexts 32768,131072 --decode-steps 16 --json out.json
    python benchmarks/e2e_h200.py --tiny            # a few-second CPU smoke run of the same code

Random bf16 weights (no download is possible), 32 layers, 32 query / 8 KV heads, d = 128. In one
process and on one device:

1. Full-budget check first: a short prompt, teacher-forced decode with dense attention and with
   HiSparse (top_k and hot buffer >= context, no quantization); exits 1 if the logits diverge.
2. Per context: chunked prefill through the model, then timed decode steps (one sequence), dense
   and HiSparse (and HiSparse with host_kv_bits=8); device memory per sequence from the allocator
   (dense KV) and from the engine (HiSparse tiers), host bytes per sequence.
3. Capacity: sequences per GPU at each context from the measured bytes per sequence, against
   device memory (dense) and device + host memory (HiSparse), and a projection for 1-2 TiB hosts.

Prints a table; --json writes every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time

import torch

from hi_sparse.hf_compat import installed_cache_kwarg, output_cache

GiB = 1 << 30
CACHE = installed_cache_kwarg()  # "cache" from transformers 5.24 on, "past_key_values" before


def build_model(tiny: bool, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=512,
                          max_position_embeddings=1 << 20, rope_theta=500000.0)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          vocab_size=128256, max_position_embeddings=1 << 20, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.eval()
    return model


def plant_heavy_hitters(model, strength: float = 16.0) -> int:
    """Give the random model the attention structure of a trained one (issue 9's high-hit-rate workload).

    Trained models attend to a few heavy-hitter tokens from every query, so the blocks a query-aware
    top-k picks change little from one decode step to the next. Random weights have no such tokens
    (hot-buffer hit rate 0.57-0.60 at 128K). This plants them: one token id (returned; put it in the
    prompt) gets a salience feature in residual dimension 0, every token a constant in dimension 1;
    no layer writes either dimension (those rows of o_proj and down_proj are zeroed), each layer's
    input norm scales both to 1 (calibrated on a short prompt), and in every head the lowest-
    frequency rotary pair (dims d/2-1, d-1, nearly position-independent: 0.3 rad over 128K at theta
    5e5) carries strength * feature: q.k gains strength^2 for a salient key from every query, about
    14 standard deviations of the random part at strength 16 with Llama's init. The rest of the
    model stays random.
    """
    cfg = model.config
    layers = model.model.layers
    d, salient = cfg.head_dim, cfg.vocab_size - 1
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        emb[:, 0] = 0.0
        emb[salient, 0] = 1.0
        emb[:, 1] = 1.0
        for layer in layers:
            layer.self_attn.o_proj.weight[:2] = 0.0
            layer.mlp.down_proj.weight[:2] = 0.0
        # calibrate: each layer's input RMS (dims 0 and 1 then stay exactly 1 and 0/1 in the residual)
        rms = []
        hooks = [layer.input_layernorm.register_forward_pre_hook(
            lambda mod, args: rms.append(args[0].float().pow(2).mean(-1).sqrt().mean())) for layer in layers]
        ids = torch.randint(0, cfg.vocab_size - 1, (1, 64), generator=torch.Generator().manual_seed(2))
        model(input_ids=ids.to(emb.device))
        for h in hooks:
            h.remove()
        for layer, r in zip(layers, rms):
            w = layer.input_layernorm.weight
            w[:2] = float(r)            # normalised dims 0 and 1 come out as ~1 (salient) and ~1
            attn = layer.self_attn
            for proj, n_heads, dim in ((attn.q_proj, cfg.num_attention_heads, 1),
                                       (attn.k_proj, cfg.num_key_value_heads, 0)):
                wt = proj.weight.view(n_heads, d, -1)
                wt[:, d // 2 - 1] = 0.0
                wt[:, d - 1] = 0.0
                wt[:, d - 1, dim] = strength
    return salient


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill(model, ids: torch.Tensor, cache, chunk: int):
    out = None
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start:start + chunk], **{CACHE: cache}, use_cache=True,
                    logits_to_keep=1)
        cache = output_cache(out)
    return out, cache


def decode(model, cache, first: torch.Tensor, steps: int, device: str,
           repeat_token: bool = False, host_times: list | None = None,
           profiles: dict | None = None) -> tuple[list[float], torch.Tensor]:
    """Greedy decode ``steps`` tokens; returns per-step seconds and the logits of each step.
    repeat_token: feed ``first`` at every step instead (a run of one token: consecutive queries
    differ by position only, the high-locality workload). host_times: appended, per step, the
    seconds until the forward call returned (its host work, the device work it waits for included:
    against the step's time it says how much of the step the host's own work takes). profiles:
    {step index: None}, each filled with the host (cProfile) and device (torch.profiler) tables of
    that step (--profile-boundary)."""
    times, logits = [], []
    tok = first
    for i in range(steps):
        sync(device)
        prof = step_profiler(device) if profiles is not None and i in profiles else None
        t0 = time.perf_counter()
        out = model(input_ids=tok, **{CACHE: cache}, use_cache=True)
        if host_times is not None:
            host_times.append(time.perf_counter() - t0)
        sync(device)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            profiles[i] = prof.close(times[-1])
        cache = output_cache(out)
        logits.append(out.logits[:, -1].float())
        tok = first if repeat_token else out.logits[:, -1:].argmax(-1)
    return times, torch.stack(logits, 1)


class step_profiler:
    """The host's Python (cProfile) and the device's kernels (torch.profiler) over one step, the
    profilers' own overhead in the step's time: read the tables, not the total."""

    def __init__(self, device: str) -> None:
        import cProfile

        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        self.torch_prof = profile(activities=acts)
        self.torch_prof.__enter__()
        self.py = cProfile.Profile()
        self.py.enable()

    def close(self, seconds: float) -> dict:
        import io
        import pstats
        self.py.disable()
        self.torch_prof.__exit__(None, None, None)
        out: dict = {"step_ms_profiled": round(1e3 * seconds, 2)}
        for order in ("tottime", "cumtime"):
            buf = io.StringIO()
            pstats.Stats(self.py, stream=buf).sort_stats(order).print_stats(22)
            out[f"python_by_{order}"] = buf.getvalue()
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        out["kernels"] = self.torch_prof.key_averages().table(sort_by=sort, row_limit=20)
        return out


def teacher_forced(model, prompt: torch.Tensor, forced: torch.Tensor, cache) -> torch.Tensor:
    out = model(input_ids=prompt, **{CACHE: cache}, use_cache=True)
    logits = [out.logits[:, -1].float()]
    cache = output_cache(out)
    for i in range(forced.shape[1] - 1):
        out = model(input_ids=forced[:, i:i + 1], **{CACHE: cache}, use_cache=True)
        cache = output_cache(out)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def static_dense(model, ids: torch.Tensor, steps: int, chunk: int, device: str) -> dict:
    """The fair dense baseline: transformers' StaticCache (preallocated, fixed shapes) with each
    decode step replayed from one CUDA graph of the whole model (eager on a CPU), what an HF user
    would pick for fast dense decode. Chunked prefill, then ``steps`` greedy steps (one warm-up
    pair first). Returns prefill seconds, step seconds and how the steps ran."""
    from transformers import StaticCache

    B, ctx = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=ctx + steps + 8)
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, ctx, chunk):
        end = min(ctx, start + chunk)
        out = model(input_ids=ids[:, start:end], **{CACHE: cache}, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(start, end, device=ids.device))
    sync(device)
    prefill_s = time.perf_counter() - t0
    tok = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([ctx], device=ids.device)

    def step() -> torch.Tensor:
        return model(input_ids=tok, **{CACHE: cache}, use_cache=True, cache_position=pos).logits[:, -1]

    graph, how = None, "eager"
    if device == "cuda":
        # warm up on a side stream (workspaces, lazy initialisation), as graph capture wants; the
        # warm-up steps write the slot of position ctx, which the first timed step writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step()
            how = "cuda graph"
        except RuntimeError as exc:    # measured eagerly then, and said so
            graph, how = None, f"eager (graph capture failed: {str(exc).splitlines()[0][:200]})"
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        if graph is not None:
            graph.replay()
        else:
            logits = step()
        sync(device)
        times.append(time.perf_counter() - t0)
        tok.copy_(logits.argmax(-1, keepdim=True))
        pos += 1
    return {"prefill_s": prefill_s, "times": times, "decode_mode": how}


def hbm_copy_rate(device: str) -> float:
    """Device memory bandwidth measured here (bytes read + written per second of a 1 GiB copy:
    the kernels benchmark's ceiling, imported only on a GPU run, where Triton is there)."""
    if device != "cuda":
        return 0.0
    from bench_kernels import hbm_copy_rate as copy_rate_gbps

    return copy_rate_gbps() * 1e9


def start_agent(row: dict, json_path: str | None):
    """easymats attached to this process at 10 Hz (a real agent process, log on, no live view)."""
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = os.path.join(os.path.dirname(os.path.abspath(json_path or "e2e.json")), "e2e_agent.log")
    cmd = [sys.executable, "-c", "import sys; from easymats.cli import main; sys.exit(main())", "--pid",
           str(os.getpid()), "--interval", "0.1", "--output", log, "--quiet", "--listen", f"127.0.0.1:{port}"]
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)            # attached and sampling before the timed steps
    row["agent"] = {"cmd": " ".join(cmd[3:]), "log": log, "alive_at_start": agent.poll() is None}
    return agent


def stop_agent(agent, row: dict) -> None:
    if agent is None:
        return
    alive = agent.poll() is None
    agent.terminate()
    try:
        _, err = agent.communicate(timeout=10)
    except Exception:  # noqa: BLE001 - a stuck agent must not lose the row
        agent.kill()
        err = ""
    lines = 0
    try:
        with open(row["agent"]["log"]) as f:
            lines = sum(1 for _ in f)
    except OSError:
        pass
    row["agent"].update(alive_at_end=alive, log_lines=lines, stderr_tail=(err or "")[-300:])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: a smoke run of this script")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--late-contexts", default="",
                    help="comma list of contexts measured like --contexts but after the --hisparse-batch runs "
                         "(so a time limit cuts these first; with --planted the model is planted by then)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens per forward)")
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--selection-block", type=int, default=None,
                    help="HiSparse selection_block_size: key bounds ranked per this many tokens inside each "
                         "storage block (default: the storage block)")
    ap.add_argument("--host-ram-gib", type=float, default=None, help="host RAM for capacity (default: this machine's)")
    ap.add_argument("--skip-quant", action="store_true")
    ap.add_argument("--variants", default=None,
                    help="comma list of single-sequence variants to run (default: dense,dense-static,hisparse,"
                         "hisparse-int8,hisparse-int4; dense-static: StaticCache + a CUDA graph per decode step; "
                         "also hisparse-int4-step: decode_graphs=\"step\", the whole forward in one graph, and "
                         "hisparse-int4-step-torch: that with decode_kernels=False, the torch reference of the step's "
                         "small kernels; -kernels: decode_kernels=True, the default)")
    ap.add_argument("--telemetry-check", action="store_true",
                    help="at the first context also run HiSparse with telemetry on and easymats attached at 10 Hz")
    ap.add_argument("--batch", type=int, default=0, help="aggregate decode of this many sequences (0 = skip)")
    ap.add_argument("--batch-context", type=int, default=32768)
    ap.add_argument("--hisparse-batch", default="",
                    help="comma list of sequence counts: prefill one --batch-context sequence with host_kv_bits=4 "
                         "(a host pool sized for them), fork it (cache.batch_repeat_interleave) and time "
                         "aggregate decode of all, greedy and on a repeated token")
    ap.add_argument("--channel-tile", type=int, default=0,
                    help="values per program of the channel-layout swap-in (0: the kernels' default)")
    ap.add_argument("--ab-phases", type=int, default=3, help="--batch-telemetry: off/on phase pairs")
    ap.add_argument("--ab-steps", type=int, default=12, help="--batch-telemetry: decode steps per phase")
    ap.add_argument("--batch-telemetry", action="store_true",
                    help="with --hisparse-batch: then, on the same batch, greedy phases alternating telemetry off "
                         "and on (publishing, easymats attached at 10 Hz), for the on-vs-off decode step")
    ap.add_argument("--dense-batch", type=int, default=0,
                    help="with --hisparse-batch: dense at this many --batch-context sequences (cache replicated)")
    ap.add_argument("--dense-static-batch", default="",
                    help="comma list of sequence counts, largest first: dense-static (the fair baseline) at the first "
                         "that runs of --batch-context sequences (e.g. 7,6,5: its largest batch on the GPU)")
    ap.add_argument("--dense-max-context", type=int, default=0,
                    help="dense decode at the largest batch of this context that fits (cache replicated)")
    ap.add_argument("--check-tol", type=float, default=None,
                    help="relative logit tolerance of the full-budget check (default 1e-4 fp32, 3e-2 bf16)")
    ap.add_argument("--split-gpus", type=int, default=1,
                    help="split the model's layers over this many GPUs (hi_sparse.split_layers); HiSparse then "
                         "keeps each layer's hot buffer on its layer's GPU")
    ap.add_argument("--step-graphs", action="store_true",
                    help='HiSparse with decode_graphs="step": the whole decode forward in one CUDA graph')
    ap.add_argument("--no-decode-kernels", action="store_true",
                    help="decode_kernels=False: the selection's assembly, the hot buffer, the key bounds and the "
                         "swap-in rows by their torch references instead of the Triton kernels (the default)")
    ap.add_argument("--no-fused-rotary", action="store_true",
                    help="fused_rotary=False: the model's own rotary embedding (about ten kernels a layer) instead "
                         "of the one-launch kernel (the default on CUDA); for an A/B in one call")
    ap.add_argument("--no-fused-projections", action="store_true",
                    help="fused_projections=False: each layer's seven weight GEMMs as the model runs them instead "
                         "of q/k/v and gate/up fused (five; the default on CUDA); for an A/B in one call")
    ap.add_argument("--no-plan-ahead", action="store_true",
                    help="engine.plan_ahead=False: a planned step's room, clocks and positions done when it is "
                         "planned, not at the end of the step before (while that one runs); for an A/B in one call")
    ap.add_argument("--ab-plan-ahead", action="store_true",
                    help="HiSparse rows: then --ab-phases pairs of --ab-steps greedy steps with "
                         "engine.plan_ahead off and on, alternating on the same cache (its A/B within one process)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="HiSparse with decode_graphs=False (the batched decode step's kernels launched every step)")
    ap.add_argument("--profile", action="store_true",
                    help="after a --hisparse-batch run, profile 2 more decode steps (torch.profiler table)")
    ap.add_argument("--batch-bits", default="4",
                    help="host_kv_bits of the --hisparse-batch rows: 4 (the default), 8, auto or budget")
    ap.add_argument("--profile-boundary", action="store_true",
                    help="profile (host cProfile and device kernels) the decode steps around the first block the "
                         "batch's tokens complete: the step before, the step that completes it, the step after; "
                         "the row gets decode_profiles and every step's host call time")
    ap.add_argument("--planted", type=int, default=0,
                    help="plant heavy hitters (plant_heavy_hitters) and put this many salient tokens, one per "
                         "block, in each --hisparse-batch prompt: a workload with a high hot-buffer hit rate")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import hi_sparse as hs
    from hi_sparse.kernels import two_level_pays

    if args.channel_tile:
        from hi_sparse.kernels import _quant_triton
        _quant_triton.ROWS_TILE_VALUES["channel"] = args.channel_tile

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.tiny:
        contexts = [min(c, 512) for c in contexts]
        args.top_k, args.window, args.block_size, args.chunk = 64, 16, 16, 128
    results: dict = {"machine": platform.node(), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
                     "torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "runs": []}
    t_build = time.perf_counter()
    model = build_model(args.tiny, dtype, device)
    if args.split_gpus > 1:
        devs = [f"cuda:{i}" for i in range(args.split_gpus)] if device == "cuda" else ["cpu"] * args.split_gpus
        hs.split_layers(model, devs)
        results["split_gpus"] = devs
    cfg = model.config
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # what a decode step must read from device memory: every weight but the embedding table (one row
    # per sequence of it), and the KV its attention reads
    read_weights = weights_bytes - model.model.embed_tokens.weight.numel() * dtype.itemsize
    hbm = hbm_copy_rate(device)
    results.update(weights_bytes=weights_bytes, kv_bytes_per_token=kv_bytes_per_token,
                   build_s=time.perf_counter() - t_build, hbm_copy_bytes_per_s=hbm)

    def limit_ms(label: str, B: int, ctx: int) -> float | None:
        """The byte-count limit of one decode step: bytes it must read / the measured HBM rate.
        Dense reads every token's K/V; HiSparse the selected tokens' (top_k + anchors per KV head
        and layer; swap-ins come over PCIe, not counted)."""
        if not hbm:
            return None
        if label.startswith("dense"):
            kv = B * ctx * kv_bytes_per_token
        else:
            per_token = kv_bytes_per_token // cfg.num_key_value_heads // cfg.num_hidden_layers   # K+V, one head
            kv = B * cfg.num_hidden_layers * cfg.num_key_value_heads * (args.top_k + 16) * per_token
        return 1e3 * (read_weights + kv) / hbm
    print(f"model: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}q/{cfg.num_key_value_heads}kv heads, "
          f"d={cfg.head_dim}, weights {weights_bytes / GiB:.1f} GiB, dense KV {kv_bytes_per_token} B/token", flush=True)
    from transformers import DynamicCache

    # 1. Full-budget check -----------------------------------------------------------------------
    g = torch.Generator().manual_seed(1)
    n_check = 64 if args.tiny else 1024
    prompt = torch.randint(0, cfg.vocab_size, (1, n_check), generator=g).to(device)
    forced = torch.randint(0, cfg.vocab_size, (1, 8), generator=g).to(device)
    with torch.no_grad():
        dense_logits = teacher_forced(model, prompt, forced, DynamicCache(config=cfg))
        # the bf16 noise floor: the same dense model through a second attention implementation
        model.set_attn_implementation("eager")
        eager_logits = teacher_forced(model, prompt, forced, DynamicCache(config=cfg))
        model.set_attn_implementation("sdpa")
        hs.enable_hisparse_kv_cache(model, max_seq_len=4 * n_check, block_size=args.block_size,
                                    selection_block_size=args.selection_block, window_size=args.window,
                                    top_k=max(args.top_k, 2 * n_check),
                                    device_buffer_tokens=max(args.top_k, 2 * n_check) * 2,
                                    telemetry=False)
        hs_logits = teacher_forced(model, prompt, forced, None)
        hs.disable_hisparse_kv_cache(model)
    scale = dense_logits.abs().max()
    err = float((dense_logits - hs_logits).abs().max() / scale)
    floor = float((dense_logits - eager_logits).abs().max() / scale)
    agree = float((dense_logits.argmax(-1) == hs_logits.argmax(-1)).float().mean())
    # fp32: a fixed bound; bf16: within 2x of what two dense implementations already differ by
    tol = args.check_tol or (1e-4 if dtype == torch.float32 else max(2 * floor, 1e-2))
    results["check"] = {"rel_max_err": err, "noise_floor_sdpa_vs_eager": floor, "top1_agreement": agree,
                        "tolerance": tol}
    print(f"full-budget check: max |dlogit| / max |logit| = {err:.2e} (tol {tol:.2e}; dense sdpa vs eager "
          f"{floor:.2e}), top-1 agreement {agree:.2f}", flush=True)
    if not err <= tol:
        print("FAIL: HiSparse with a full budget diverges from dense attention", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 1

    # 2. Decode per context (one sequence), then aggregate decode of a batch ---------------------
    def save() -> None:
        if args.json:  # partial results survive a time limit
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    ab_phases, ab_steps = args.ab_phases, args.ab_steps   # --batch-telemetry: off/on phase pairs, steps each

    def measure(label: str, bits, ids: torch.Tensor, repeat: int = 1, inputs: tuple[bool, ...] = (False,),
                pool_blocks: int | None = None, telemetry_ab: bool = False) -> dict:
        """Prefill ids (B, T) and time decode steps; dense, or HiSparse with host_kv_bits=bits.
        repeat > 1: prefill one row, then decode `repeat` copies of its cache (dense: replicated
        tensors; HiSparse: forked engine sequences, each with its own host blocks). inputs: one
        timed decode per entry on the same cache, greedy (False) or a repeated token (True); one
        row each. telemetry_ab: then, on the same cache, greedy phases alternating telemetry off
        (nothing published, no agent) and on (publishing, easymats attached at 10 Hz); one more row.
        Returns the last row."""
        B, ctx = ids.shape[0] * repeat, ids.shape[1]
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        row = {"context": ctx, "batch": B, "variant": label, "limit_ms": limit_ms(label, B, ctx)}
        first_row = row
        results["runs"].append(row)   # filled in below; saved even if the run dies part way
        if label == "dense-static":
            try:
                with torch.no_grad():
                    r = static_dense(model, ids.repeat(repeat, 1), args.decode_steps, max(1, args.chunk // B), device)
                steady = r["times"][2:] or r["times"]
                row.update(prefill_s=r["prefill_s"], decode_mode=r["decode_mode"], decode_input="greedy",
                           decode_step_ms_median=1e3 * median(steady), decode_step_ms_all=[round(1e3 * t, 2)
                                                                                          for t in r["times"]],
                           decode_tokens_per_s=B / median(steady),
                           decode_tokens_per_s_mean=B * len(steady) / sum(steady),
                           device_kv_bytes=kv_bytes_per_token * (ctx + args.decode_steps), host_kv_bytes=0)
                if device == "cuda":
                    row["device_peak_bytes_over_weights"] = torch.cuda.max_memory_allocated() - base
            except torch.cuda.OutOfMemoryError as exc:
                row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
            print(json.dumps({k: v for k, v in row.items() if k not in ("decode_step_ms_all", "decode_profiles")}),
                  flush=True)
            save()
            return row
        try:
            with torch.no_grad():
                if label == "dense":
                    cache = DynamicCache(config=cfg)
                else:
                    telemetry = label.endswith("+easymats") or telemetry_ab
                    hs.enable_hisparse_kv_cache(model, max_seq_len=ctx + extra_tokens,
                                                block_size=args.block_size, window_size=args.window,
                                                selection_block_size=args.selection_block,
                                                top_k=args.top_k, host_kv_bits=bits, telemetry=telemetry,
                                                audit_every=0, name="e2e", host_pool_blocks=pool_blocks,
                                                decode_kernels=not (args.no_decode_kernels or label.endswith("-torch")),
                                                fused_rotary=False if args.no_fused_rotary else None,
                                                fused_projections=False if args.no_fused_projections else None,
                                                decode_graphs=False if args.no_graphs else
                                                "step" if args.step_graphs or "-step" in label
                                                else True)
                    cache = None
                    hs.integration.binding_of(model).engine.plan_ahead = not args.no_plan_ahead
                    if telemetry_ab:
                        # telemetry off until its phases: the publisher's interval is a public knob
                        hs.integration.binding_of(model).engine.publisher.interval_s = math.inf
                t0 = time.perf_counter()
                out, cache = prefill(model, ids, cache, max(1, args.chunk // ids.shape[0]))
                sync(device)
                row["prefill_s"] = time.perf_counter() - t0
                first = out.logits[:, -1:].argmax(-1)
                cache = output_cache(out)
                del out
                if repeat > 1:
                    t0 = time.perf_counter()
                    cache.batch_repeat_interleave(repeat)
                    first = first.repeat_interleave(repeat, 0)
                    sync(device)
                    row["repeat_s"] = time.perf_counter() - t0
                shared = dict(row)
                for k, repeat_token in enumerate(inputs):
                    row = first_row if k == 0 else dict(shared)
                    row["decode_input"] = "repeated token" if repeat_token else "greedy"
                    eng = None if label == "dense" else hs.integration.binding_of(model).engine
                    before = (0, 0)
                    if eng is not None:
                        st = eng.stats
                        before = (st.hot_buffer_lookups, st.hot_buffer_hits)
                    agent = start_agent(row, args.json) if label.endswith("+easymats") else None
                    host: list[float] = []
                    profiles = None
                    if args.profile_boundary and eng is not None:    # the step whose token completes a block
                        at = cache.get_seq_length()
                        done = next(i for i in range(args.block_size) if (at + i + 1) % args.block_size == 0)
                        profiles = {i: None for i in (done - 1, done, done + 1) if 0 <= i < args.decode_steps}
                    try:
                        times, _ = decode(model, cache, first, args.decode_steps, device, repeat_token, host,
                                          profiles)
                    finally:
                        stop_agent(agent, row)
                    if profiles is not None:
                        row["decode_profiles"] = {str(i): p for i, p in profiles.items()}
                        row["decode_call_ms_all"] = [round(1e3 * t, 2) for t in host]
                        for i, p in profiles.items():
                            print(f"--- step {i} (position {at + i}): {p and p['step_ms_profiled']} ms profiled; "
                                  f"host call {1e3 * host[i]:.2f} ms", flush=True)
                            for name in ("python_by_tottime", "python_by_cumtime", "kernels"):
                                print((p or {}).get(name, ""), flush=True)
                    steady = times[2:] or times
                    row["decode_step_ms_median"] = 1e3 * median(steady)
                    # until the forward returned (host work; a sync inside it waits for the device)
                    row["decode_call_ms_median"] = 1e3 * median(host[2:] or host)
                    row["decode_step_ms_all"] = [round(1e3 * t, 2) for t in times]
                    row["decode_tokens_per_s"] = B / median(steady)
                    row["decode_tokens_per_s_mean"] = B * len(steady) / sum(steady)
                    if device == "cuda":
                        row["device_peak_bytes_over_weights"] = torch.cuda.max_memory_allocated() - base
                    if eng is None:
                        row["device_kv_bytes"] = kv_bytes_per_token * (ctx + args.decode_steps)
                        row["host_kv_bytes"] = 0
                    else:
                        mem = eng.memory_bytes()
                        row["device_kv_bytes"] = (mem[("device", "data")] + mem[("device", "metadata")]) // B
                        row["host_kv_bytes"] = (mem[("host", "data")] + mem[("host", "metadata")]) // B
                        row["memory_by_tier_all_sequences"] = {f"{t}/{k}": v for (t, k), v in mem.items()}
                        # host RAM of the batch against one sequence's (forks share the prompt's blocks)
                        row["host_blocks_in_use"] = eng.pool.num_active
                        row["host_blocks_one_sequence"] = -(-ctx // eng.cfg.cache_block_size)
                        row["host_pool_blocks"] = eng.pool.num_blocks
                        st = eng.stats
                        lookups, hits = st.hot_buffer_lookups - before[0], st.hot_buffer_hits - before[1]
                        row["hot_buffer_hit_rate"] = hits / lookups if lookups else None
                        graphs = hs.step_graph.of(model)
                        row["decode_steps_by_path"] = dict(graphs.counts) if graphs is not None else None
                        row["decode_steps_planned_ahead"] = eng._decoder.ahead_used
                        if args.ab_plan_ahead and k == 0:
                            plan_ahead_phases(row, eng, cache, first)
                        row["two_level_scoring"] = two_level_pays(-(-ctx // eng.cfg.cache_block_size),
                                                                  eng.cfg.bound_group, eng._decoder.n_super)
                    if row is not first_row:
                        results["runs"].append(row)
                    if args.profile and eng is not None and k == len(inputs) - 1 and repeat > 1:
                        from torch.profiler import ProfilerActivity, profile
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            decode(model, cache, first, 2, device, repeat_token)
                        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                        row["profile_top_cpu"] = table
                        print(table, flush=True)
                    print(json.dumps({k: v for k, v in row.items()
                                      if k not in ("decode_step_ms_all", "decode_profiles")}), flush=True)
                    save()
                if telemetry_ab:
                    row = telemetry_phases(dict(shared, variant=label + "+easymats", decode_input="greedy A/B"),
                                           cache, first, B)
                del cache
        except torch.cuda.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
            print(json.dumps(row), flush=True)
        finally:
            try:
                hs.disable_hisparse_kv_cache(model)
            except ValueError:
                pass
        save()
        return row

    def plan_ahead_phases(row: dict, eng, cache, first: torch.Tensor) -> None:
        """ab_phases pairs of ab_steps greedy steps with plan_ahead off, then on (the first two
        steps of a phase dropped: the first still takes what the phase before prepared)."""
        times, calls = {False: [], True: []}, {False: [], True: []}
        tok, default = first, eng.plan_ahead
        for phase in range(2 * ab_phases):
            eng.plan_ahead = bool(phase % 2)
            host: list[float] = []
            t, logits = decode(model, cache, tok, ab_steps, device, host_times=host)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            times[eng.plan_ahead] += t[2:]
            calls[eng.plan_ahead] += host[2:]
        eng.plan_ahead = default
        for on, name in ((False, "off"), (True, "on")):
            row[f"plan_ahead_{name}_step_ms_median"] = 1e3 * median(times[on])
            row[f"plan_ahead_{name}_call_ms_median"] = 1e3 * median(calls[on])
            row[f"plan_ahead_{name}_step_ms"] = [round(1e3 * x, 2) for x in times[on]]

    def telemetry_phases(row: dict, cache, first: torch.Tensor, B: int) -> dict:
        """Alternate ab_phases pairs of off / on phases of ab_steps greedy steps on one engine: the
        same sequences, context and hit rate on both sides, so the difference is telemetry's."""
        engine = hs.integration.binding_of(model).engine
        pub, publish_every = engine.publisher, engine.cfg.publish_interval_s
        results["runs"].append(row)
        times = {"off": [], "on": []}
        tok = first
        # the publishing work itself, timed where it runs (the A/B's difference is within noise)
        spent, publish, calls = [0.0], pub.maybe_publish, []

        def timed_publish(*a, **kw):
            t0 = time.perf_counter()
            try:
                return publish(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
                calls.append(time.perf_counter() - t0)
        pub.maybe_publish = timed_publish
        for phase in range(2 * ab_phases):
            side = "on" if phase % 2 else "off"
            agent = start_agent(row, args.json) if side == "on" else None
            pub.interval_s = math.inf if side == "off" else publish_every
            before = spent[0]
            try:
                t, logits = decode(model, cache, tok, ab_steps, device)
            finally:
                pub.interval_s = math.inf
                stop_agent(agent, row)
            if side == "off":
                spent[0] = before           # calls that returned at once (interval inf)
                calls.clear()
            else:
                row.setdefault("publish_us_calls", []).extend(round(1e6 * c, 1) for c in calls)
                calls.clear()
            tok = logits[:, -1].argmax(-1, keepdim=True)
            times[side] += t[1:]              # the first step of a phase follows the agent's start
        on, off = median(times["on"]), median(times["off"])
        row.update(decode_step_ms_median=1e3 * on, decode_step_ms_off_median=1e3 * off,
                   decode_step_ms_on=[round(1e3 * t, 2) for t in times["on"]],
                   decode_step_ms_off=[round(1e3 * t, 2) for t in times["off"]],
                   decode_tokens_per_s=B / on, decode_tokens_per_s_mean=B * len(times["on"]) / sum(times["on"]),
                   telemetry_overhead_pct=100 * (on / off - 1), phases=2 * ab_phases, steps_per_phase=ab_steps,
                   publish_us_per_step=1e6 * spent[0] / (ab_phases * ab_steps),
                   publish_pct_of_step=100 * spent[0] / (ab_phases * ab_steps) / off,
                   publish_us_median=median(row.get("publish_us_calls") or [0.0]),
                   publish_us_top=sorted(row.get("publish_us_calls") or [])[-8:])
        del pub.maybe_publish                   # the method again
        # In the steps the publishing calls also wait for room in the launch queue (the GPU is
        # behind), which the step's own sync waits for anyway; its CPU cost, with the GPU idle:
        sync(device)
        gauge_every = pub.gauge_interval_s
        for kind, gauges in (("cheap", math.inf), ("costly", 0.0)):
            pub.interval_s, pub.gauge_interval_s = 0.0, gauges
            spent_idle = []
            for _ in range(30):
                t0 = time.perf_counter()
                pub.maybe_publish()
                spent_idle.append(time.perf_counter() - t0)
                sync(device)
            row[f"publish_{kind}_us_idle"] = 1e6 * median(spent_idle)
        pub.interval_s, pub.gauge_interval_s = math.inf, gauge_every
        per_step = row["publish_cheap_us_idle"] + row["publish_costly_us_idle"] * min(1.0, off / gauge_every)
        row["publish_idle_pct_of_step"] = 100 * per_step / 1e6 / off
        results.setdefault("batch_telemetry_overhead_pct", {})[B] = row["telemetry_overhead_pct"]
        print(f"telemetry on + easymats at 10 Hz vs off, {B} x {row['context']}, alternating phases on one engine: "
              f"decode step {1e3 * on:.2f} vs {1e3 * off:.2f} ms ({row['telemetry_overhead_pct']:+.2f} %); publishing "
              f"{row['publish_us_per_step']:.0f} us per step ({row['publish_pct_of_step']:.3f} % of it; a call: median "
              f"{row['publish_us_median']:.0f} us, largest {row['publish_us_top']}); CPU cost of a publish, GPU "
              f"idle: {row['publish_cheap_us_idle']:.0f} us, with the costly gauges "
              f"{row['publish_costly_us_idle']:.0f} us (every {gauge_every:g} s): "
              f"{row['publish_idle_pct_of_step']:.3f} % of the step; "
              f"agent {row.get('agent')}", flush=True)
        save()
        return row

    variants = [("dense", None), ("dense-static", None), ("hisparse", None)]
    variants += [] if args.skip_quant else [("hisparse-int8", 8), ("hisparse-int4", 4)]
    # by name: whole-step graphs beside per-layer ones; -lru: with the hot buffer's Triton kernels
    known_only = [("hisparse-int4-step", 4), ("hisparse-int4-step-kernels", 4), ("hisparse-int4-step-torch", 4)]
    if args.variants:
        known = dict(variants + known_only)
        bad = [v for v in args.variants.split(",") if v not in known]
        if bad:
            raise SystemExit(f"unknown --variants {bad}; choose from {', '.join(known)}")
        variants = [(v, known[v]) for v in args.variants.split(",")]
    extra_tokens = 4 * args.decode_steps + (2 * ab_phases * ab_steps if args.batch_telemetry or args.ab_plan_ahead
                                            else 0)
    def singles(ctxs: list[int], first: bool) -> None:
        for ci, ctx in enumerate(ctxs):
            ids = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g).to(device)
            extra = [("hisparse+easymats", None)] if first and ci == 0 and args.telemetry_check else []
            for label, bits in variants + extra:
                measure(label, bits, ids)

    singles(contexts, True)
    if args.batch > 1:
        ids = torch.randint(0, cfg.vocab_size, (1, args.batch_context), generator=g).to(device)
        for label in ("dense", "hisparse"):
            measure(label, None, ids.repeat(args.batch, 1))
    salient = plant_heavy_hitters(model) if args.planted else None
    if salient is not None:
        results["planted"] = {"salient_token": salient, "tokens_per_prompt": args.planted}
    for n in [int(x) for x in args.hisparse_batch.split(",") if x]:
        ctx = args.batch_context
        ids = torch.randint(0, cfg.vocab_size - 1, (1, ctx), generator=g).to(device)
        if salient is not None:
            # one salient token in each of `planted` blocks, spread over the prompt before its window
            picked = torch.randperm(max(1, (ctx - args.window) // args.block_size), generator=g)[:args.planted]
            ids[0, picked.to(device) * args.block_size + args.block_size // 2] = salient
        # copy-on-write forks: one copy of the prompt's blocks, and each sequence's own blocks from
        # its partly filled last one on (what its decode adds)
        blocks = -(-ctx // args.block_size) + n * (-(-extra_tokens // args.block_size) + 1)
        bits = int(args.batch_bits) if args.batch_bits.isdigit() else args.batch_bits
        measure("hisparse-int4" if bits == 4 else f"hisparse-{bits}", bits, ids, repeat=n, inputs=(False, True),
                pool_blocks=blocks, telemetry_ab=args.batch_telemetry)
    singles([min(int(c), 512) if args.tiny else int(c) for c in args.late_contexts.split(",") if c], not contexts)
    if args.dense_batch:
        ids = torch.randint(0, cfg.vocab_size, (1, args.batch_context), generator=g).to(device)
        measure("dense", None, ids, repeat=args.dense_batch, inputs=(False, True))
    for n in [int(x) for x in args.dense_static_batch.split(",") if x]:
        ids = torch.randint(0, cfg.vocab_size, (1, args.batch_context), generator=g).to(device)
        if "error" not in measure("dense-static", None, ids, repeat=n):
            results["dense_static_max_batch"] = {"context": args.batch_context, "sequences": n}
            break
    if args.dense_max_context and device == "cuda":
        ctx = args.dense_max_context
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g).to(device)
        gc.collect()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        n = max(1, int((free - 6 * GiB) // (kv_bytes_per_token * (ctx + args.decode_steps))))
        while n >= 1 and "error" in measure("dense", None, ids, repeat=n):
            n -= 1
        results["dense_max_batch"] = {"context": ctx, "sequences": n}

    # 3. Capacity from measured bytes per sequence ---------------------------------------------
    if device != "cuda":
        return 0
    hbm = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0
    host_ram = (args.host_ram_gib * GiB if args.host_ram_gib
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    reserve = 8 * GiB  # activations, allocator slack, CUDA context
    cap = []
    single = [r for r in results["runs"] if "error" not in r and r["batch"] == 1]
    for row in single:
        dev_free = hbm - weights_bytes - reserve
        by_dev = int(dev_free // row["device_kv_bytes"]) if row["device_kv_bytes"] else 0
        by_host = int((host_ram - 16 * GiB) // row["host_kv_bytes"]) if row["host_kv_bytes"] else None
        fit = by_dev if by_host is None else min(by_dev, by_host)
        proj = {f"{t}TiB_host": (min(by_dev, int((t * 1024 - 16) * GiB // row["host_kv_bytes"]))
                                  if row["host_kv_bytes"] else by_dev) for t in (1, 2)}
        cap.append({"context": row["context"], "variant": row["variant"], "sequences_by_device": by_dev,
                    "sequences_by_host": by_host, "sequences_fit": fit, **proj})
    results["capacity"] = cap
    print("\n| context | variant | decode ms (limit ms) | decode tok/s (1 seq) | device B/seq | host B/seq "
          "| seqs fit (device, host) | 1 TiB / 2 TiB host |")
    print("|---|---|---|---|---|---|---|---|")
    for row, c in zip(single, cap):
        print(f"| {row['context']} | {row['variant']} | {row['decode_step_ms_median']:.1f} "
              f"({_ms(row.get('limit_ms'))}) | "
              f"{row['decode_tokens_per_s']:.1f} | "
              f"{row['device_kv_bytes'] / GiB:.2f} GiB | {row['host_kv_bytes'] / GiB:.2f} GiB | "
              f"{c['sequences_fit']} ({c['sequences_by_device']}, {c['sequences_by_host']}) | "
              f"{c['1TiB_host']} / {c['2TiB_host']} |")
    batched = [r for r in results["runs"] if "error" not in r and r["batch"] > 1]
    if batched:
        print("\n| context | variant | sequences | decode input | decode step ms (limit ms) | aggregate tok/s "
              "(median step; mean) | hot-buffer hit rate |")
        print("|---|---|---|---|---|---|---|")
        for r in batched:
            hit = r.get("hot_buffer_hit_rate")
            print(f"| {r['context']} | {r['variant']} | {r['batch']} | {r['decode_input']} | "
                  f"{r['decode_step_ms_median']:.1f} ({_ms(r.get('limit_ms'))}) | {r['decode_tokens_per_s']:.1f}; "
                  f"{r['decode_tokens_per_s_mean']:.1f} | {'-' if hit is None else f'{hit:.2f}'} |")
    on = [r for r in single if r["variant"] == "hisparse+easymats"]
    off = [r for r in single if r["variant"] == "hisparse" and on and r["context"] == on[0]["context"]]
    if on and off:
        pct = 100 * (on[0]["decode_step_ms_median"] / off[0]["decode_step_ms_median"] - 1)
        results["telemetry_overhead_pct"] = pct
        print(f"\ntelemetry on + easymats at 10 Hz vs telemetry off, {on[0]['context']} tokens: decode step "
              f"{on[0]['decode_step_ms_median']:.2f} vs {off[0]['decode_step_ms_median']:.2f} ms ({pct:+.2f} %); "
              f"agent {on[0].get('agent')}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
