"""Prompts in, validated and routed ``Request`` objects out.

Every request is checked before any work starts, so a bad one raises ``ValueError`` saying
what is wrong and nothing else changes: an empty or over-long prompt, token ids outside the
vocabulary, a request larger than the KV pool, a deterministic request to an engine without
the self-test. The router (DESIGN 4) decides here which requests are deterministic.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sid.engine.kv_cache import cdiv
from sid.engine.request import Request
from sid.engine.router import RequestContext, Router, RouterPolicy
from sid.model.config import CheckpointError, ModelConfig
from sid.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
DEFAULT_DETERMINISTIC_SEED = 0
"""Seed of a deterministic request that samples (temperature > 0) without giving one."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts only)."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from None


def eos_token_ids(path: Path, cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """End-of-sequence ids from the config, the generation config and the tokenizer."""
    ids = set(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def router_policy(policy: RouterPolicy | dict[str, Any] | str | Path | None) -> RouterPolicy:
    """A ``RouterPolicy`` from itself, its dict form, or a path to its JSON file; None = the default."""
    if policy is None:
        return RouterPolicy()
    if isinstance(policy, RouterPolicy):
        return policy
    if isinstance(policy, dict):
        return RouterPolicy.from_dict(policy)
    return RouterPolicy.from_file(policy)


@dataclass
class InputProcessor:
    """Turns prompts and sampling parameters into requests for one engine's limits."""

    tokenizer: PreTrainedTokenizerBase | None
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_determinism: bool
    canonical_domain: str
    eos_token_ids: frozenset[int]
    router: Router
    seed: int = 0
    _arrivals: int = 0
    _seed_rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._seed_rng = random.Random(self.seed)

    def make_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None, context: RequestContext | None
    ) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids, salt = self._tokenize(prompt)
        deterministic, _ = self.router.decide(params, context)
        request = self._new_request(request_id, ids, params, text, deterministic)
        request.cache_salt = salt
        return request

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of any accepted prompt form."""
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids instead of text")
            return prompt, self.tokenizer(prompt).input_ids, salt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, prompt, salt
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: use a string, token ids or a dict")

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
        deterministic: bool
    ) -> Request:
        vocab = self.vocab_size
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - n
        if room < (1 if params.max_tokens != 0 else 0):
            raise ValueError(
                f"the prompt has {n} tokens, which leaves no room to generate within max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        blocks = cdiv(n + max_tokens, self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks ({n} prompt + {max_tokens} new tokens) but the cache has "
                f"only {self.num_blocks}; lower max_tokens or enlarge the cache"
            )
        if deterministic and not self.enable_determinism:
            raise ValueError("deterministic requests need enable_determinism=True (the start-up self-test)")
        if params.seed is not None:
            seed = params.seed
        else:
            seed = DEFAULT_DETERMINISTIC_SEED if deterministic else self._seed_rng.getrandbits(63)
        self._arrivals += 1
        return Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            arrival=self._arrivals,
            deterministic=deterministic,
            domain=self.canonical_domain if deterministic else "fast",
        )
