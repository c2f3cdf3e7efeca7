"""Receipts of deterministic responses, and replaying them for audits.

A receipt holds what is needed to recompute a deterministic response bit for bit (the
prompt's token ids, every sampling parameter, the seed actually used) plus the numerics
fingerprint it was served under and a SHA-256 of the output token ids. ``sid replay``
re-runs it on an engine with the same fingerprint and reports a match or the first
divergence; under another fingerprint it refuses, since no guarantee spans fingerprints.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sid.engine.engine import LLMEngine
from sid.outputs import RequestOutput
from sid.sampling_params import SamplingParams

RECEIPT_VERSION = 1


def token_hash(token_ids: list[int]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()


_NOT_RECORDED = ("output_kind",)  # how outputs are delivered, not what they are


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in fields(SamplingParams) if f.init and f.name not in _NOT_RECORDED}


def make_receipt(output: RequestOutput, params: SamplingParams, seed: int, model: str) -> dict[str, Any]:
    """The JSON record of a finished deterministic response."""
    if not output.deterministic or not output.finished:
        raise ValueError("receipts are for finished deterministic responses")
    completion = output.outputs[0]
    return {
        "version": RECEIPT_VERSION,
        "request_id": output.request_id,
        "model": model,
        "fingerprint": output.fingerprint,
        "prompt": output.prompt,
        "prompt_token_ids": output.prompt_token_ids,
        "params": {**_params_dict(params), "seed": seed, "deterministic": True},
        "num_output_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "output_token_ids": completion.token_ids,
        "output_hash": token_hash(completion.token_ids),
    }


def append_receipt(path: str | Path, receipt: dict[str, Any]) -> None:
    with Path(path).open("a") as f:
        f.write(json.dumps(receipt) + "\n")


def load_receipts(path: str | Path) -> list[dict[str, Any]]:
    """One receipt per line (JSON Lines), or a single JSON object."""
    text = Path(path).read_text()
    try:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        records = [json.loads(text)]
    for i, r in enumerate(records):
        missing = {"fingerprint", "prompt_token_ids", "params", "output_hash"} - set(r)
        if missing:
            raise ValueError(f"receipt {i} in {path} lacks {sorted(missing)}")
    return records


@dataclass
class ReplayResult:
    request_id: str | None
    match: bool
    first_divergence: int | None
    expected_tokens: int
    replayed_tokens: int
    output_hash: str


class FingerprintMismatch(ValueError):
    """The receipt was served under other numerics: replaying it proves nothing."""


def replay(engine: LLMEngine, receipt: dict[str, Any]) -> ReplayResult:
    """Re-run one receipt; its recorded token ids, when present, locate a divergence."""
    if receipt["fingerprint"] != engine.fingerprint:
        raise FingerprintMismatch(
            f"receipt fingerprint {receipt['fingerprint']} differs from this engine's {engine.fingerprint}: "
            "same bits are only promised under the same numerics (model weights, dtype, canonical rows, "
            "kernels, library versions and processor)"
        )
    params = SamplingParams(**receipt["params"])
    rid = f"replay-{receipt.get('request_id', '')}"
    engine.add_request(rid, {"prompt_token_ids": receipt["prompt_token_ids"]}, params)
    final: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    tokens = final.outputs[0].token_ids
    digest = token_hash(tokens)
    divergence = None
    expected_token_ids = receipt.get("output_token_ids")
    if expected_token_ids is not None:
        divergence = next((i for i, (a, b) in enumerate(zip(tokens, expected_token_ids)) if a != b), None)
        if divergence is None and len(tokens) != len(expected_token_ids):
            divergence = min(len(tokens), len(expected_token_ids))
    return ReplayResult(
        request_id=receipt.get("request_id"),
        match=digest == receipt["output_hash"],
        first_divergence=divergence,
        expected_tokens=receipt.get("num_output_tokens", -1),
        replayed_tokens=len(tokens),
        output_hash=digest,
    )
