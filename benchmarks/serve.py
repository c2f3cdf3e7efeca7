"""Online serving: Poisson arrivals against `sid serve`, the latencies `vllm bench serve` reports.

Each run sends ``--num-prompts`` streaming completions (random token-id prompts of
``--input-len``, ``--output-len`` new tokens, ``ignore_eos``, greedy) at one request rate,
with a share of them deterministic (``--deterministic-fractions``, chosen by a seeded draw).
Measured at the client: TTFT (request sent to first streamed chunk), ITL (gaps between
chunks), TPOT ((end-to-end - TTFT) / (tokens - 1)) and end-to-end latency, as mean /
median / p99, per traffic class, plus request and token throughput; the server's own
counters (rollbacks, canonical-lane fill, ...) are scraped before and after each run.

    python benchmarks/serve.py --model llama-3.1-8b            # H200: starts `sid serve` (dummy weights)
    python benchmarks/serve.py --url http://127.0.0.1:8000      # a server already running
    python benchmarks/serve.py --smoke                          # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, SMOKE_MODEL, model_dir, parse_args, table, write_json  # noqa: E402

from sid.model.builtin import default_model_path  # noqa: E402

SERVER_COUNTERS = (
    "sid_deterministic_requests_total",
    "sid_verifications_total",
    "sid_rollbacks_total",
    "sid_recomputed_tokens_total",
    "sid_canonical_rows_used_total",
    "sid_canonical_rows_padded_total",
    "sid_preemptions_total",
)


@dataclass
class Result:
    deterministic: bool
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, deterministic: bool
) -> Result:
    """One streamed completion, timed chunk by chunk as it arrives."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "deterministic": deterministic,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(deterministic)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = last - start
        result.ok = result.output_tokens == max_tokens
        if not result.ok:
            result.error = f"got {result.output_tokens} of {max_tokens} tokens"
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run_rate(
    url: str, model: str, requests: list[tuple[list[int], int, bool]], rate: float, seed: int
) -> tuple[list[Result], float]:
    """Send every request with exponential gaps of mean 1/rate (all at once for rate inf)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens, deterministic in requests:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, max_tokens, deterministic)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[Result], seconds: float) -> dict[str, Any]:
    """vLLM's serving metrics (milliseconds) over the successful requests."""
    ok = [r for r in results if r.ok]
    row: dict[str, Any] = {"requests": len(results), "failed": len(results) - len(ok)}
    if not ok:
        return row
    out_tokens = sum(r.output_tokens for r in ok)
    row.update(req_s=len(ok) / seconds, out_tok_s=out_tokens / seconds)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    for name, values in series.items():
        if values:
            values = sorted(v * 1000 for v in values)
            row[f"{name}_mean"] = statistics.fmean(values)
            row[f"{name}_median"] = statistics.median(values)
            row[f"{name}_p99"] = values[min(len(values) - 1, int(0.99 * len(values)))]
    return row


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in SERVER_COUNTERS
    }


class Server:
    """`sid serve MODEL --port 0 ...` in a subprocess, logging to a file; its URL once healthy."""

    def __init__(self, model: str, serve_args: list[str], log: Path) -> None:
        cmd = [sys.executable, "-m", "sid", "serve", model, "--port", "0", "--no-access-log"]
        self.log = log
        self.proc = subprocess.Popen([*cmd, *serve_args], stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.url = self._wait()

    def _wait(self, timeout: float = 900.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sid serve exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            match = re.search(r"serving .* on (http://\S+)", self.log.read_text())
            if match:
                try:
                    if httpx.get(f"{match.group(1)}/health", timeout=5).status_code == 200:
                        return match.group(1)
                except httpx.TransportError:
                    pass
            time.sleep(0.5)
        raise RuntimeError("sid serve did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def sweep(url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Every (deterministic fraction, rate) run: table rows per traffic class, and the raw runs."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    asyncio.run(run_rate(url, model, [(p, 4, False) for p in prompts[:4]], float("inf"), 0))  # warm-up
    rows, raw = [], []
    for fraction in (float(f) for f in args.deterministic_fractions.split(",")):
        draw = random.Random(args.seed + 1)
        requests = [(p, args.output_len, draw.random() < fraction) for p in prompts]
        for rate in (float(r) for r in args.rates.split(",")):
            before = scrape(url)
            results, seconds = asyncio.run(run_rate(url, model, requests, rate, args.seed))
            after = scrape(url)
            counters = {k.removeprefix("sid_").removesuffix("_total"): after[k] - before.get(k, 0) for k in after}
            used, padded = counters.get("canonical_rows_used", 0), counters.get("canonical_rows_padded", 0)
            run = {"det_frac": fraction, "rate": rate, "seconds": seconds}
            classes = {
                "all": results,
                "normal": [r for r in results if not r.deterministic],
                "det": [r for r in results if r.deterministic],
            }
            summaries = {cls: summarize(subset, seconds) for cls, subset in classes.items() if subset}
            for cls, summary in summaries.items():
                if cls == "all" or 0 < fraction < 1:
                    rows.append({**run, "class": cls, **summary})
            if "det" in summaries and "normal" in summaries and 0 < fraction < 1:
                ratios = {f"{m}_median": summaries["det"].get(f"{m}_median", 0)
                          / summaries["normal"].get(f"{m}_median", 1)
                          for m in ("ttft", "tpot", "itl", "e2e")}
                rows.append({**run, "class": "det/normal", **ratios})
            errors = sorted({r.error for r in results if r.error})
            raw.append(
                {
                    **run,
                    "server": {**counters, "canonical_fill": used / (used + padded) if used + padded else None},
                    "errors": errors[:5],
                    "results": [asdict(r) for r in results],
                }
            )
            failed = sum(not r.ok for r in results)
            print(f"deterministic {fraction:.2f}, rate {rate}: {seconds:.1f} s, {failed} failed", file=sys.stderr)
    return rows, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset (llama-3.1-8b, qwen3-0.6b: dummy weights) or checkpoint path")
    ap.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    ap.add_argument("--serve-args", default="", help="extra `sid serve` arguments, one string")
    ap.add_argument("--rates", default="2,8,32,inf", help="request rates (req/s), comma-separated; inf = all at once")
    ap.add_argument("--deterministic-fractions", default="0,0.25", help="shares of deterministic requests")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below this (default: config)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, rates="16,inf", deterministic_fractions="0,0.5", num_prompts=8,
                                     input_len=16, output_len=8, serve_args="--device cpu --num-kv-blocks 256"))
    serve_args = args.serve_args.split()
    if args.model in PRESETS:
        serve_args += ["--load-format", "dummy"]
        if "--max-model-len" not in serve_args:
            serve_args += ["--max-model-len", str(args.input_len + args.output_len + 16)]
    path = model_dir(args.model) or (None if args.url else str(default_model_path()))
    vocab = args.vocab_size or (json.loads((Path(path) / "config.json").read_text())["vocab_size"] if path else 1000)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    server = None if args.url else Server(str(path), serve_args, Path(tempfile.mkdtemp()) / "serve.log")
    try:
        rows, raw = sweep(args.url or server.url, prompts, args)  # type: ignore[union-attr]
    finally:
        if server is not None:
            server.stop()
    meta = {k: getattr(args, k) for k in ("model", "url", "num_prompts", "input_len", "output_len")}
    out = write_json(
        f"serve_{Path(args.model or 'default').name}",
        {**meta, "serve_args": serve_args, "rows": rows, "runs": raw},
        args.out,
    )
    columns = ["det_frac", "rate", "class", "requests", "failed", "req_s", "out_tok_s"]
    columns += [f"{m}_{s}" for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "p99")]
    print(f"{args.model or path}: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out (ms)")
    print(table(rows, columns))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
