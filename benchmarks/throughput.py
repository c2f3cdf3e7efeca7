"""Offline throughput on the published workload, and the Hugging Face peer beside it.

Workload (DESIGN 7): ``--requests`` requests with prompt and output lengths uniform in
[100, 1024], ``ignore_eos``, greedy, dummy weights of a real config. The peer is
transformers' own continuous batching (``generate_batch`` with ``attn_implementation=
"paged|sdpa"``); it is slow, so both engines also run the same ``--peer-requests`` subset
with ``--peer-tokens`` new tokens each, and the ratio is taken there.

    python benchmarks/throughput.py --model qwen3-0.6b [--peer]      # H200
    python benchmarks/throughput.py --smoke                           # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, SMOKE_MODEL, engine_device, model_dir, parse_args, table, workload, write_json  # noqa: E402

from sid import LLM, SamplingParams  # noqa: E402


def sid_run(llm: LLM, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p, _ in requests)
    return {"seconds": seconds, "output_tok_s": out_tokens / seconds, "total_tok_s": (in_tokens + out_tokens) / seconds,
            "output_tokens": out_tokens}


def peer_run(path: str | None, requests: list[tuple[list[int], int]], new_tokens: int, device: str) -> dict[str, float]:
    """transformers' continuous batching on the same prompts (random weights of the same config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="paged|sdpa", dtype=torch.bfloat16).to(device)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [p for p, _ in requests]
    model.generate_batch(inputs=prompts[:4], generation_config=gen)  # warm-up
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"seconds": seconds, "output_tok_s": out_tokens / seconds, "output_tokens": out_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset (llama-3.1-8b, qwen3-0.6b: dummy weights) or checkpoint path")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--peer", action="store_true", help="also run the transformers peer on the subset")
    ap.add_argument("--peer-requests", type=int, default=64)
    ap.add_argument("--peer-tokens", type=int, default=128)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) the model is split over")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--lockstep", action="store_true",
                    help="also run the full workload without overlapped scheduling, on the same engine")
    args = parse_args(
        ap, smoke=dict(model=SMOKE_MODEL, requests=16, min_len=16, max_len=48, peer_requests=8, peer_tokens=16)
    )
    path = model_dir(args.model)
    llm = LLM(
        path,
        load_format="dummy" if args.model in PRESETS else "auto",
        device=engine_device(args),
        max_model_len=2 * args.max_len + 16,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    engine = llm.llm_engine
    requests = workload(args.requests, args.min_len, args.max_len, engine.model_config.vocab_size)
    sid_run(llm, requests[:8])  # warm-up
    overlap = "sid" if engine.async_scheduling else "sid (lockstep)"
    rows = [{"engine": overlap, "workload": f"{args.requests} req", **sid_run(llm, requests)}]
    if args.lockstep and engine.async_scheduling:
        engine.async_scheduling = False
        rows.append({"engine": "sid (lockstep)", "workload": f"{args.requests} req", **sid_run(llm, requests)})
        rows[-1]["overlap_gain"] = rows[0]["output_tok_s"] / rows[-1]["output_tok_s"]
        engine.async_scheduling = True
    subset = [(p, args.peer_tokens) for p, _ in requests[: args.peer_requests]]
    sid_run(llm, [(p, 4) for p, _ in subset])  # warm-up: kernel variants of this batch's first steps
    rows.append({"engine": overlap, "workload": f"{len(subset)} req x {args.peer_tokens} new", **sid_run(llm, subset)})
    if args.peer:
        peer = peer_run(engine.config.model, subset, args.peer_tokens, str(engine.device))
        rows[-1]["ratio_to_peer"] = rows[-1]["output_tok_s"] / peer["output_tok_s"]
        rows.append({"engine": "transformers", "workload": f"{len(subset)} req x {args.peer_tokens} new", **peer})
    meta = {"model": args.model, "device": str(engine.device), "dtype": str(engine.dtype),
            "tensor_parallel_size": args.tensor_parallel_size,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "kv_blocks": engine.kv.pool.num_blocks, "cuda_graphs": engine.runner.graphs is not None,
            "async_scheduling": engine.async_scheduling,
            "stats": engine.get_stats()}
    out = write_json(f"throughput_{Path(args.model or 'default').name}", {**meta, "rows": rows}, args.out)
    print(f"{args.model or engine.config.model} on {meta['gpu'] or meta['device']} ({meta['dtype']}), "
          f"{meta['kv_blocks']} KV blocks")
    print(table(rows, ["engine", "workload", "seconds", "output_tok_s", "total_tok_s", "overlap_gain",
                       "ratio_to_peer"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
