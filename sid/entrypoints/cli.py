"""The ``sid`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from sid.engine.plan import STRATEGIES

if TYPE_CHECKING:
    from sid.engine.router import RouterPolicy


def _ranged(kind: type[int] | type[float], low: float, high: float | None = None) -> Callable[[str], int | float]:
    """An argparse type for options with a range: out of it, argparse's error names the option."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not (low <= value and (high is None or value <= high)):  # NaN fails too
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse says "invalid int value" for what kind() refuses
    return parse


def _add_engine_args(p: argparse.ArgumentParser, model_option: bool = True) -> None:
    """The engine options every command shares (EngineConfig's fields)."""
    if model_option:
        p.add_argument("--model", default=None, help="local Hugging Face checkpoint (default: the built-in tiny one)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--tp-invariant-chunks", type=int, default=None,
        help="deterministic requests get the same bits at every TP size dividing this (a power of two)",
    )
    p.add_argument(
        "--collective-timeout-s", type=float, default=120.0,
        help="under TP, a collective that waits this long for a worker fails the step (a hung worker)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-determinism", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--canonical-rows", type=int, default=None)
    p.add_argument(
        "--max-canonical-rows", type=int, default=None,
        help="largest pass that may carry deterministic rows (default: at least max-num-batched-tokens where the GEMMs "
        "are proven row-invariant; otherwise max-num-batched-tokens on GPU, 8x canonical-rows on CPU)",
    )
    p.add_argument(
        "--canonical-sizes-per-octave", type=int, default=None,
        help="pass sizes per doubling above canonical-rows (default: 16 on GPU, 8 on CPU where the GEMMs are proven "
        "row-invariant; otherwise 8 on GPU, 1 on CPU)",
    )
    p.add_argument("--verify-window", type=int, default=8)
    p.add_argument("--determinism-strategy", default="auto", choices=STRATEGIES)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="plan step N+1 while the GPU runs step N (default: on for CUDA devices)",
    )


_ENGINE_FIELDS = (
    "device", "dtype", "max_model_len", "load_format", "enforce_eager", "tensor_parallel_size",
    "tp_invariant_chunks", "collective_timeout_s",
    "gpu_memory_utilization", "num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
    "enable_prefix_caching", "enable_determinism", "canonical_rows", "max_canonical_rows",
    "canonical_sizes_per_octave", "verify_window",
    "determinism_strategy", "attention_backend", "async_scheduling",
)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {name: getattr(args, name) for name in _ENGINE_FIELDS}


def _generate(args: argparse.Namespace) -> int:
    from sid import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
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
    llm = LLM(args.model or records[0].get("model"), **_engine_kwargs(args))
    failures = 0
    for record in records:
        result = replay(llm.llm_engine, record)
        failures += not result.match
        where = "" if result.match else f", first divergence at token {result.first_divergence}"
        verdict = "MATCH" if result.match else "MISMATCH"
        print(f"{result.request_id}: {verdict} ({result.replayed_tokens} tokens{where})")
        if args.json:
            print(json.dumps(asdict(result)))
    return 1 if failures else 0


def _repro(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sid import LLM
    from sid.repro import COMPOSITIONS, GREEDY, Repro, Target, determinism_held, format_table, summarize, write_report

    targets = (GREEDY,)
    if args.sampled_temperature > 0:
        targets += (Target("sampled", args.sampled_temperature, args.sampled_seed),)
    llm = LLM(args.model, **_engine_kwargs(args))
    engine = llm.llm_engine
    repro = Repro(
        engine, max_tokens=args.max_tokens, trials=args.trials, long_prompt=args.long_prompt, prompt=args.prompt,
        targets=targets,
    )
    runs = repro.run()
    meta = {
        "model": engine.config.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "fingerprint": engine.fingerprint,
        "canonical_rows": engine.canonical_rows,
        "canonical_sizes": list(engine.canonical.sizes),
        "verify_window": engine.config.verify_window,
        "max_tokens": args.max_tokens,
        "trials": args.trials,
        "targets": {t.name: t.describe() for t in targets},
        "engine_stats": engine.get_stats(),
    }
    json_path, png_path = write_report(runs, Path(args.out), meta, args.max_tokens)
    print(f"one prompt, {len(COMPOSITIONS)} batch compositions x {args.trials} trials; targets: "
          + "; ".join(t.describe() for t in targets))
    print(format_table(runs))
    print(f"fingerprint {engine.fingerprint}; wrote {json_path} and {png_path}")
    return 0 if determinism_held(summarize(runs)) else 1


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="local Hugging Face checkpoint (default: built-in tiny)")
    _add_engine_args(p, model_option=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=_ranged(int, 0, 65535), default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="the `model` clients pass (default: MODEL as given)")
    p.add_argument("--api-key", action="append", default=None, help="accept this bearer key (repeat for several)")
    p.add_argument("--router-config", default=None, help="JSON router policy: rules choosing deterministic requests")
    p.add_argument(
        "--deterministic-default",
        action="store_true",
        help="requests that do not say otherwise are deterministic (the router policy's default)",
    )
    p.add_argument("--receipts", default=None, help="append a receipt of each deterministic response to FILE")
    p.add_argument(
        "--max-pending", type=_ranged(int, 1), default=1024, help="unfinished requests beyond this are answered 429"
    )
    p.add_argument(
        "--shutdown-timeout", type=_ranged(float, 0), default=30.0, help="seconds in-flight requests get after SIGTERM"
    )
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True, help="log every HTTP request")
    p.add_argument("--seed", type=int, default=0, help="engine seed (draws seeds for unseeded sampled requests)")


def _serve(args: argparse.Namespace) -> int:
    from sid.config import EngineConfig
    from sid.engine.engine import LLMEngine
    from sid.entrypoints.server import ServerSettings, run_server
    from sid.model.builtin import default_model_path

    model = args.model or str(default_model_path())
    settings = ServerSettings(
        served_model_name=args.served_model_name or model,
        api_keys=tuple(args.api_key or ()),
        receipts=args.receipts,
        max_pending=args.max_pending,
        shutdown_timeout=args.shutdown_timeout,
    )
    engine = LLMEngine(
        EngineConfig(
            model=model, seed=args.seed, router_policy=serve_router_policy(args),
            **_engine_kwargs(args),  # type: ignore[arg-type]
        )
    )
    run_server(engine, settings, host=args.host, port=args.port, access_log=args.access_log)
    return 0


def serve_router_policy(args: argparse.Namespace) -> RouterPolicy:
    """``--router-config``'s policy, its default turned on by ``--deterministic-default``."""
    from sid.engine.inputs import router_policy

    policy = router_policy(args.router_config)
    return replace(policy, default=True) if args.deterministic_default else policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sid", description="Sid LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--deterministic", action="store_true",
        help="ask for bit-identical output whatever else runs (a deterministic request)",
    )
    gen.add_argument("--receipts", default=None, help="append a receipt of each deterministic response to FILE")
    repro = sub.add_parser(
        "repro", help="the repro experiment: one prompt, six batch compositions, normal vs deterministic"
    )
    _add_engine_args(repro)
    repro.add_argument("--prompt", default=None, help="target prompt (default: a fixed code prompt)")
    repro.add_argument("--max-tokens", type=_ranged(int, 1), default=48)
    repro.add_argument("--trials", type=_ranged(int, 1), default=3)
    repro.add_argument("--long-prompt", type=_ranged(int, 2), default=384, help="length of the long co-tenant prompts")
    repro.add_argument(
        "--sampled-temperature", type=_ranged(float, 0), default=1.0,
        help="also run the target sampled at this temperature with a fixed seed (0: greedy lanes only)",
    )
    repro.add_argument("--sampled-seed", type=_ranged(int, 0, 2**63 - 1), default=7, help="seed of the sampled target")
    repro.add_argument("--out", default="out/repro", help="folder for repro.json and repro.png")
    rep = sub.add_parser("replay", help="re-run recorded deterministic responses and check their bits")
    rep.add_argument("record", help="a receipts file (JSON Lines) written by `sid generate --receipts` or the server")
    _add_engine_args(rep)
    rep.add_argument("--json", action="store_true", help="also print each result as JSON")
    _add_serve_args(sub.add_parser("serve", help="the OpenAI-compatible HTTP server"))
    args = parser.parse_args(argv)
    try:
        return {"generate": _generate, "repro": _repro, "replay": _replay, "serve": _serve}[args.command](args)
    except ValueError as exc:
        print(f"sid: error: {exc}", file=sys.stderr)
        return 2
