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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sid", description="Sid LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        return {"generate": _generate}[args.command](args)
    except ValueError as exc:
        print(f"sid: error: {exc}", file=sys.stderr)
        return 2
