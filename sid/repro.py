"""The repro experiment (DESIGN 7): one fixed prompt under six batch compositions.

For each composition and trial the target prompt runs beside co-tenants, once as a normal
request and once as a deterministic one, and for each of its targets: greedy (DESIGN 7's
definition) and, by default, seeded sampling at temperature 1.0 as well. Each pair of
(mode, target) is a *lane*. A run records the hash of the target's tokens, where they first
diverge from the lane's alone run, whether its logprobs equal that run's bit for bit, and
what the deterministic path cost (rollbacks, recomputed tokens). Normal runs may differ as
soon as batch shapes change the kernels' reduction order -- in the logprobs long before a
confident model flips a token; deterministic runs must not differ in any bit.
"""

from __future__ import annotations

import json
import math
import random
import struct
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
MODES = ("normal", "deterministic")
DEFAULT_PROMPT = "def fibonacci(n):\n"


@dataclass(frozen=True)
class Target:
    """How the target prompt is decoded: greedy, or sampled with a fixed seed.

    A seeded sample is a pure function of (seed, position) and the logits, so it too must not
    change with the batch; where two tokens' noisy scores lie closer than the logits drift, it
    flips, which a confident model's greedy choice rarely does."""

    name: str
    temperature: float = 0.0
    seed: int | None = None

    def lane(self, mode: str) -> str:
        """``normal`` / ``deterministic`` for greedy (DESIGN 7's lanes), ``<mode>_<name>`` otherwise."""
        return mode if self.name == "greedy" else f"{mode}_{self.name}"

    def describe(self) -> str:
        return "greedy" if self.temperature == 0.0 else f"{self.name}: temperature {self.temperature}, seed {self.seed}"


GREEDY = Target("greedy")
SAMPLED = Target("sampled", temperature=1.0, seed=7)


@dataclass
class TargetResult:
    """The target's tokens and the logprob of each chosen token."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class ReproRun:
    lane: str
    mode: str
    target: str
    composition: str
    trial: int
    output_hash: str
    first_divergence: int | None
    logprobs_bit_equal: bool
    """Every chosen token's logprob has the bits of the lane's alone run (trial 0)."""
    max_abs_logprob_diff: float
    """Largest |logprob - alone run's| over the tokens before the first divergence."""
    num_tokens: int
    rollbacks: int
    recomputed_tokens: int
    seconds: float
    token_ids: list[int] = field(repr=False)
    logprobs: list[float] = field(repr=False)


def _hash(tokens: list[int]) -> str:
    return xxhash.xxh64_hexdigest(",".join(map(str, tokens)).encode())


def _bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _divergence(tokens: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, ref)):
        if a != b:
            return i
    return None if len(tokens) == len(ref) else min(len(tokens), len(ref))


def compare(result: TargetResult, ref: TargetResult) -> tuple[int | None, bool, float]:
    """First token divergence, logprobs bit-equal, and the largest logprob drift before the divergence
    (after it the two runs condition on different tokens)."""
    div = _divergence(result.token_ids, ref.token_ids)
    shared = len(result.token_ids) if div is None else div
    drift = max((abs(a - b) for a, b in zip(result.logprobs[:shared], ref.logprobs[:shared])), default=0.0)
    return div, _bits(result.logprobs) == _bits(ref.logprobs), drift


class Repro:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_tokens: int,
        trials: int,
        long_prompt: int,
        prompt: str | None,
        targets: tuple[Target, ...] = (GREEDY, SAMPLED),
    ) -> None:
        self.engine = engine
        self.targets = targets
        self.max_tokens = max_tokens
        self.trials = trials
        vocab = engine.model_config.vocab_size
        if engine.tokenizer is not None:
            self.prompt = engine.tokenizer(prompt or DEFAULT_PROMPT).input_ids
        else:
            self.prompt = random.Random(0).choices(range(vocab), k=16)
        # Co-tenants: prompts of up to 64 tokens, or the target's plus up to 24, then up to 12 new tokens.
        need = max(64, len(self.prompt) + 24) + 12
        if engine.max_model_len < need:
            raise ValueError(f"the repro's co-tenants need max_model_len >= {need}, got {engine.max_model_len}")
        self.long_prompt = min(long_prompt, engine.max_model_len - 40)
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

    def run_one(self, mode: str, target: Target, composition: str, count: int, trial: int) -> TargetResult:
        engine = self.engine
        rng = random.Random(1000 * trial + count)
        cotenants = self._cotenants(mode, composition, count, rng)
        params = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=target.temperature,
            seed=target.seed,
            logprobs=0,
            ignore_eos=True,
            deterministic=mode == "deterministic",
        )
        mid_generation = composition.startswith("+255")
        if not mid_generation:
            for tokens, cotenant in cotenants[: count // 2]:
                self._add(tokens, cotenant)
        rid = self._add(self.prompt, params)
        if not mid_generation:
            for tokens, cotenant in cotenants[count // 2 :]:
                self._add(tokens, cotenant)
        result = None
        added_late = not mid_generation
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    result = out.outputs[0]
                    if not added_late and len(result.token_ids) >= self.max_tokens // 4:
                        for tokens, cotenant in cotenants:
                            self._add(tokens, cotenant)
                        added_late = True
        assert result is not None and result.logprobs is not None
        chosen = [position[token].logprob for position, token in zip(result.logprobs, result.token_ids)]
        return TargetResult(list(result.token_ids), chosen)

    def run(self) -> list[ReproRun]:
        runs: list[ReproRun] = []
        stats = self.engine.stats
        for mode in MODES:
            for target in self.targets:
                reference: TargetResult | None = None
                for trial in range(self.trials):
                    for name, count in COMPOSITIONS:
                        before = (stats.rollbacks, stats.recomputed_tokens)
                        start = time.perf_counter()
                        result = self.run_one(mode, target, name, count, trial)
                        seconds = time.perf_counter() - start
                        if reference is None:
                            reference = result
                        div, bit_equal, drift = compare(result, reference)
                        runs.append(
                            ReproRun(
                                lane=target.lane(mode),
                                mode=mode,
                                target=target.name,
                                composition=name,
                                trial=trial,
                                output_hash=_hash(result.token_ids),
                                first_divergence=div,
                                logprobs_bit_equal=bit_equal,
                                max_abs_logprob_diff=drift,
                                num_tokens=len(result.token_ids),
                                rollbacks=stats.rollbacks - before[0],
                                recomputed_tokens=stats.recomputed_tokens - before[1],
                                seconds=seconds,
                                token_ids=result.token_ids,
                                logprobs=result.logprobs,
                            )
                        )
        return runs


def lanes(runs: list[ReproRun]) -> list[str]:
    """The lanes in the order they ran."""
    return list(dict.fromkeys(r.lane for r in runs))


def summarize(runs: list[ReproRun]) -> dict[str, dict[str, Any]]:
    out = {}
    for lane in lanes(runs):
        mine = [r for r in runs if r.lane == lane]
        out[lane] = {
            "mode": mine[0].mode,
            "target": mine[0].target,
            "runs": len(mine),
            "distinct_outputs": len({r.output_hash for r in mine}),
            "diverged_runs": sum(r.first_divergence is not None for r in mine),
            "logprob_diff_runs": sum(not r.logprobs_bit_equal for r in mine),
            "max_abs_logprob_diff": max(r.max_abs_logprob_diff for r in mine),
            "rollbacks": sum(r.rollbacks for r in mine),
            "recomputed_tokens": sum(r.recomputed_tokens for r in mine),
        }
    return out


def determinism_held(summary: dict[str, dict[str, Any]]) -> bool:
    """Every deterministic run matched its lane's alone run in every token and logprob bit."""
    deterministic = [s for s in summary.values() if s["mode"] == "deterministic"]
    return all(s["diverged_runs"] == 0 and s["logprob_diff_runs"] == 0 for s in deterministic)


def _aligned(rows: list[list[str]]) -> list[str]:
    """Rows of cells, each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _drift(run: ReproRun) -> str:
    if run.logprobs_bit_equal:
        return "bit-equal"
    return f"differ, max {run.max_abs_logprob_diff:.1e}"


def verdict(summary: dict[str, dict[str, Any]]) -> list[str]:
    """What the run shows, in words: never a success where nothing was shown."""
    normal = [s for s in summary.values() if s["mode"] == "normal"]
    runs = sum(s["runs"] for s in normal)
    diverged = sum(s["diverged_runs"] for s in normal)
    differ = sum(s["logprob_diff_runs"] for s in normal)
    drift = max((s["max_abs_logprob_diff"] for s in normal), default=0.0)
    if not differ and not diverged:
        lines = [
            f"NO BATCH VARIANCE SHOWN: all {runs} normal runs matched their alone run in every token and logprob bit, "
            "so this run demonstrates nothing about the problem (these kernels did not change a row's bits with the "
            "batch here; float32 on a CPU does)."
        ]
    elif not diverged:
        lines = [
            f"Normal requests: the batch changed the logprobs of {differ} of {runs} runs (max |delta| {drift:.1e}), "
            "but no token flipped: a flip needs two candidates closer than that drift."
        ]
    else:
        lines = [
            f"Normal requests: tokens diverged in {diverged} of {runs} runs, logprobs in {differ} "
            f"(max |delta| before a divergence {drift:.1e})."
        ]
    if determinism_held(summary):
        lines.append("Deterministic requests: every run matched its alone run in every token and logprob bit.")
    else:
        lines.append("DETERMINISM BROKEN: a deterministic run differs from its alone run (see the table).")
    return lines


def format_table(runs: list[ReproRun]) -> str:
    trials = sorted({r.trial for r in runs})
    blocks = []
    for target in dict.fromkeys(r.target for r in runs):
        rows = [["", "normal", "", "", "deterministic", "", "", ""]]
        rows.append([f"target: {target}", *["hash", "diverges at", "logprobs"] * 2, "rollbacks"])
        mine = {(r.mode, r.composition, r.trial): r for r in runs if r.target == target}
        for name, _ in COMPOSITIONS:
            for trial in trials:
                row = [f"{name} (trial {trial})"]
                for mode in MODES:
                    r = mine[mode, name, trial]
                    div = "-" if r.first_divergence is None else str(r.first_divergence)
                    row += [r.output_hash[:12], div, _drift(r)]
                rows.append(row + [str(r.rollbacks)])
        blocks.append("\n".join(_aligned(rows)))
    summary = summarize(runs)
    lines = []
    for lane, s in summary.items():
        lines.append(
            f"{lane}: {s['distinct_outputs']} distinct output(s) in {s['runs']} runs, {s['diverged_runs']} diverged; "
            f"logprobs differ in {s['logprob_diff_runs']} (max |delta| {s['max_abs_logprob_diff']:.1e}); "
            f"rollbacks {s['rollbacks']}, recomputed tokens {s['recomputed_tokens']}"
        )
    return "\n\n".join([*blocks, "\n".join(lines + verdict(summary))])


LANE_STYLE = {"normal": ("tab:red", -0.2), "deterministic": ("tab:green", 0.2)}
TARGET_MARKER = {"greedy": "o", "sampled": "^"}


def plot(runs: list[ReproRun], path: Path, max_tokens: int) -> None:
    """Per composition and lane: the first diverging token (none drawn at full length) above, and how far
    the logprobs drifted below (bit-equal runs on the bottom line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    names = [n for n, _ in COMPOSITIONS]
    drifts = [r.max_abs_logprob_diff for r in runs if not r.logprobs_bit_equal and r.max_abs_logprob_diff > 0]
    floor = 10 ** math.floor(math.log10(min(drifts))) / 10 if drifts else 1e-9
    targets = list(dict.fromkeys(r.target for r in runs))
    for lane in lanes(runs):
        mine = [r for r in runs if r.lane == lane]
        color, offset = LANE_STYLE[mine[0].mode]
        offset += 0.08 * (targets.index(mine[0].target) - (len(targets) - 1) / 2)
        xs = [names.index(r.composition) + offset + 0.03 * (r.trial - 1) for r in mine]
        style = dict(color=color, marker=TARGET_MARKER.get(mine[0].target, "s"), s=28, label=lane)
        top.scatter(xs, [max_tokens if r.first_divergence is None else r.first_divergence for r in mine], **style)
        drawn = [floor if r.logprobs_bit_equal else max(r.max_abs_logprob_diff, floor) for r in mine]
        bottom.scatter(xs, drawn, **style)
    top.set_ylabel("first diverging token")
    top.set_ylim(-1, max_tokens + 3)
    top.axhline(max_tokens, color="gray", lw=0.5, ls="--")
    top.set_title("Same prompt, six batch compositions x trials: tokens (top line = identical output)", fontsize=10)
    bottom.set_yscale("log")
    ceiling = 10 ** math.ceil(math.log10(max([floor * 10, *drifts])))
    decades = [10.0**e for e in range(round(math.log10(floor)) + 1, round(math.log10(ceiling)) + 1)]
    bottom.set_yticks([floor, *decades], ["bit-equal", *(f"{d:.0e}" for d in decades)])
    bottom.minorticks_off()
    bottom.set_ylim(floor / 3, ceiling * 1.5)
    bottom.axhline(floor, color="gray", lw=0.5, ls="--")
    bottom.set_ylabel("max |logprob - alone run's|")
    bottom.set_title("logprobs of the same tokens (bottom line = bit-equal to the alone run)", fontsize=10)
    bottom.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(runs: list[ReproRun], out_dir: Path, meta: dict[str, Any], max_tokens: int) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "repro.json", out_dir / "repro.png"
    json_path.write_text(json.dumps({**meta, "summary": summarize(runs), "runs": [asdict(r) for r in runs]}, indent=1))
    plot(runs, png_path, max_tokens)
    return json_path, png_path
