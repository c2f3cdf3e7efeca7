"""The repro experiment (DESIGN 7): one fixed prompt under six batch compositions.

For each composition and trial the target prompt runs (greedily by default) beside co-tenants, once as
a normal request and once as a deterministic one. Each run records the hash of the
target's output, where it first diverges from the target run alone, and what the
deterministic path cost (rollbacks, recomputed tokens). Normal runs may diverge as soon as
batch shapes change the kernels' reduction order; deterministic runs must not.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from sid.engine.engine import LLMEngine
from sid.sampling_params import SamplingParams

COMPOSITIONS = (
    ("alone", 0),
    ("+1", 1),
    ("+7", 7),
    ("+31 mixed lengths", 31),
    ("+127 with long prompts", 127),
    ("+255 mid-generation, shared prefix", 255),
)
DEFAULT_PROMPT = "def fibonacci(n):\n"


@dataclass
class ReproRun:
    mode: str
    composition: str
    trial: int
    output_hash: str
    first_divergence: int | None
    num_tokens: int
    rollbacks: int
    recomputed_tokens: int
    seconds: float
    token_ids: list[int] = field(repr=False)


def _hash(tokens: list[int]) -> str:
    return xxhash.xxh64_hexdigest(",".join(map(str, tokens)).encode())


def _divergence(tokens: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, ref)):
        if a != b:
            return i
    return None if len(tokens) == len(ref) else min(len(tokens), len(ref))


class Repro:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_tokens: int,
        trials: int,
        long_prompt: int,
        prompt: str | None,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.engine = engine
        self.temperature, self.seed = temperature, seed
        self.max_tokens = max_tokens
        self.trials = trials
        self.long_prompt = min(long_prompt, engine.max_model_len - 40)
        vocab = engine.model_config.vocab_size
        if engine.tokenizer is not None:
            self.prompt = engine.tokenizer(prompt or DEFAULT_PROMPT).input_ids
        else:
            self.prompt = random.Random(0).choices(range(vocab), k=16)
        self.vocab = vocab
        self._ids = 0

    def _cotenants(
        self, mode: str, composition: str, count: int, rng: random.Random
    ) -> list[tuple[list[int], SamplingParams]]:
        """Random co-tenants; in deterministic mode every eighth is deterministic too."""
        out = []
        for i in range(count):
            if composition.startswith("+127") and i % 16 == 0:
                n = rng.randint(self.long_prompt // 2, self.long_prompt)
            else:
                n = rng.randint(4, 64)
            tokens = rng.choices(range(self.vocab), k=n)
            if composition.startswith("+255"):
                tokens = self.prompt + tokens[: rng.randint(1, 24)]
            params = SamplingParams(
                max_tokens=rng.randint(2, 12),
                temperature=rng.choice([0.0, 1.0]),
                seed=rng.randrange(1 << 30),
                ignore_eos=True,
                deterministic=mode == "deterministic" and i % 8 == 0,
            )
            out.append((tokens, params))
        return out

    def _add(self, tokens: list[int], params: SamplingParams) -> str:
        self._ids += 1
        rid = f"repro-{self._ids}"
        self.engine.add_request(rid, {"prompt_token_ids": tokens}, params)
        return rid

    def run_one(self, mode: str, composition: str, count: int, trial: int) -> list[int]:
        engine = self.engine
        rng = random.Random(1000 * trial + count)
        cotenants = self._cotenants(mode, composition, count, rng)
        target = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            ignore_eos=True,
            deterministic=mode == "deterministic",
        )
        mid_generation = composition.startswith("+255")
        if not mid_generation:
            for tokens, params in cotenants[: count // 2]:
                self._add(tokens, params)
        rid = self._add(self.prompt, target)
        if not mid_generation:
            for tokens, params in cotenants[count // 2 :]:
                self._add(tokens, params)
        result: list[int] | None = None
        added_late = not mid_generation
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    result = out.outputs[0].token_ids
                    if not added_late and len(result) >= self.max_tokens // 4:
                        for tokens, params in cotenants:
                            self._add(tokens, params)
                        added_late = True
        assert result is not None
        return result

    def run(self) -> list[ReproRun]:
        runs: list[ReproRun] = []
        stats = self.engine.stats
        for mode in ("normal", "deterministic"):
            reference: list[int] | None = None
            for trial in range(self.trials):
                for name, count in COMPOSITIONS:
                    before = (stats.rollbacks, stats.recomputed_tokens)
                    start = time.perf_counter()
                    tokens = self.run_one(mode, name, count, trial)
                    seconds = time.perf_counter() - start
                    if reference is None:
                        reference = tokens
                    runs.append(
                        ReproRun(
                            mode=mode,
                            composition=name,
                            trial=trial,
                            output_hash=_hash(tokens),
                            first_divergence=_divergence(tokens, reference),
                            num_tokens=len(tokens),
                            rollbacks=stats.rollbacks - before[0],
                            recomputed_tokens=stats.recomputed_tokens - before[1],
                            seconds=seconds,
                            token_ids=tokens,
                        )
                    )
        return runs


def summarize(runs: list[ReproRun]) -> dict[str, dict[str, Any]]:
    out = {}
    for mode in ("normal", "deterministic"):
        mine = [r for r in runs if r.mode == mode]
        out[mode] = {
            "runs": len(mine),
            "distinct_outputs": len({r.output_hash for r in mine}),
            "diverged_runs": sum(r.first_divergence is not None for r in mine),
            "rollbacks": sum(r.rollbacks for r in mine),
            "recomputed_tokens": sum(r.recomputed_tokens for r in mine),
        }
    return out


def format_table(runs: list[ReproRun]) -> str:
    lines = [f"{'composition':<36} {'normal: hash / diverges at':<34} {'deterministic: hash / diverges at':<36} rollbacks"]
    for name, _ in COMPOSITIONS:
        trials = sorted({r.trial for r in runs})
        for trial in trials:
            cells = []
            det_rollbacks = 0
            for mode in ("normal", "deterministic"):
                r = next(x for x in runs if x.mode == mode and x.composition == name and x.trial == trial)
                div = "-" if r.first_divergence is None else str(r.first_divergence)
                cells.append(f"{r.output_hash[:12]} / {div}")
                if mode == "deterministic":
                    det_rollbacks = r.rollbacks
            lines.append(f"{name + f' (trial {trial})':<36} {cells[0]:<34} {cells[1]:<36} {det_rollbacks}")
    summary = summarize(runs)
    for mode, s in summary.items():
        lines.append(
            f"{mode}: {s['distinct_outputs']} distinct output(s) in {s['runs']} runs, {s['diverged_runs']} diverged; "
            f"rollbacks {s['rollbacks']}, recomputed tokens {s['recomputed_tokens']}"
        )
    return "\n".join(lines)


def plot(runs: list[ReproRun], path: Path, max_tokens: int) -> None:
    """First divergence per run (no divergence drawn at full length), normal vs deterministic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [n for n, _ in COMPOSITIONS]
    for offset, mode, color in ((-0.15, "normal", "tab:red"), (0.15, "deterministic", "tab:green")):
        xs, ys = [], []
        for r in runs:
            if r.mode == mode:
                xs.append(names.index(r.composition) + offset + 0.05 * (r.trial - 1))
                ys.append(max_tokens if r.first_divergence is None else r.first_divergence)
        ax.scatter(xs, ys, color=color, label=mode, s=30)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("first divergence from the alone run (token)")
    ax.set_ylim(-1, max_tokens + 3)
    ax.axhline(max_tokens, color="gray", lw=0.5, ls="--")
    ax.set_title("Same prompt, six batch compositions x trials (top line = identical output)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(runs: list[ReproRun], out_dir: Path, meta: dict[str, Any], max_tokens: int) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "repro.json", out_dir / "repro.png"
    json_path.write_text(json.dumps({**meta, "summary": summarize(runs), "runs": [asdict(r) for r in runs]}, indent=1))
    plot(runs, png_path, max_tokens)
    return json_path, png_path
