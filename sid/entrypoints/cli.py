"""The ``sid`` command line."""

from __future__ import annotations

import argparse
import json
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
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        deterministic=True if args.deterministic else None,
    )
    engine = llm.llm_engine
    requests = [engine.make_request(f"cli-{i}", p, params) for i, p in enumerate(args.prompt)]
    for request in requests:
        engine.enqueue(request)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    for request in requests:
        out = finished[request.request_id]
        sys.stdout.write((out.prompt or "") + out.outputs[0].text + "\n")
        if args.receipts and out.deterministic:
            from sid.receipts import append_receipt, make_receipt

            append_receipt(args.receipts, make_receipt(out, params, request.seed, engine.config.model or ""))
    if args.deterministic:
        print(f"fingerprint {engine.fingerprint}", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from sid import LLM
    from sid.receipts import load_receipts, replay

    records = load_receipts(args.record)
    llm = LLM(args.model or records[0].get("model"), device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    failures = 0
    for record in records:
        result = replay(llm.llm_engine, record)
        failures += not result.match
        where = "" if result.match else f", first divergence at token {result.first_divergence}"
        print(f"{result.request_id}: {'MATCH' if result.match else 'MISMATCH'} ({result.replayed_tokens} tokens{where})")
        if args.json:
            print(json.dumps(asdict(result)))
    return 1 if failures else 0


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
    gen.add_argument("--deterministic", action="store_true", help="serve through the canonical lane")
    gen.add_argument("--receipts", default=None, help="append a receipt of each deterministic response to FILE")
    repro = sub.add_parser("repro", help="the repro experiment: one prompt, six batch compositions, normal vs deterministic")
    _add_engine_args(repro)
    repro.add_argument("--prompt", default=None, help="target prompt (default: a fixed code prompt)")
    repro.add_argument("--max-tokens", type=int, default=48)
    repro.add_argument("--trials", type=int, default=3)
    repro.add_argument("--long-prompt", type=int, default=384, help="length of the long co-tenant prompts")
    repro.add_argument("--canonical-rows", type=int, default=None)
    repro.add_argument("--verify-window", type=int, default=8)
    repro.add_argument("--out", default="out/repro", help="folder for repro.json and repro.png")
    rep = sub.add_parser("replay", help="re-run recorded deterministic responses and check their bits")
    rep.add_argument("record", help="a receipts file (JSON Lines) written by `sid generate --receipts` or the server")
    _add_engine_args(rep)
    rep.add_argument("--json", action="store_true", help="also print each result as JSON")
    args = parser.parse_args(argv)
    try:
        return {"generate": _generate, "repro": _repro, "replay": _replay}[args.command](args)
    except ValueError as exc:
        print(f"sid: error: {exc}", file=sys.stderr)
        return 2
