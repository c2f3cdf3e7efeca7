"""The ``sid`` command line."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint (default: the built-in tiny model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--enforce-eager", action="store_true")


def _generate(args: argparse.Namespace) -> int:
    from sid import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        sys.stdout.write(out.prompt or "")
        sys.stdout.write(out.outputs[0].text + "\n")
    return 0


def _repro(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sid import LLM
    from sid.repro import Repro, format_table, write_report

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        canonical_rows=args.canonical_rows,
        verify_window=args.verify_window,
    )
    engine = llm.llm_engine
    repro = Repro(engine, max_tokens=args.max_tokens, trials=args.trials, long_prompt=args.long_prompt, prompt=args.prompt)
    runs = repro.run()
    meta = {
        "model": engine.config.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "fingerprint": engine.fingerprint,
        "canonical_rows": engine.canonical_rows,
        "verify_window": engine.config.verify_window,
        "max_tokens": args.max_tokens,
        "trials": args.trials,
        "engine_stats": engine.get_stats(),
    }
    json_path, png_path = write_report(runs, Path(args.out), meta, args.max_tokens)
    print(format_table(runs))
    print(f"fingerprint {engine.fingerprint}; wrote {json_path} and {png_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sid", description="Sid LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    repro = sub.add_parser("repro", help="the repro experiment: one prompt, six batch compositions, normal vs deterministic")
    _add_engine_args(repro)
    repro.add_argument("--prompt", default=None, help="target prompt (default: a fixed code prompt)")
    repro.add_argument("--max-tokens", type=int, default=48)
    repro.add_argument("--trials", type=int, default=3)
    repro.add_argument("--long-prompt", type=int, default=384, help="length of the long co-tenant prompts")
    repro.add_argument("--canonical-rows", type=int, default=None)
    repro.add_argument("--verify-window", type=int, default=8)
    repro.add_argument("--out", default="out/repro", help="folder for repro.json and repro.png")
    args = parser.parse_args(argv)
    try:
        return {"generate": _generate, "repro": _repro}[args.command](args)
    except ValueError as exc:
        print(f"sid: error: {exc}", file=sys.stderr)
        return 2
