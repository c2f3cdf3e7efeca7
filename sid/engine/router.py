"""The sensitivity router: which requests take the deterministic path (DESIGN 4).

Precedence: the request's own ``deterministic`` field, then the ``X-Sid-Deterministic``
header, then the first matching policy rule (by API key, OpenAI ``user``, model, or
sampling settings), then the policy default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sid.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestContext:
    """Who asked, as the server knows it; empty for offline use."""

    api_key: str | None = None
    user: str | None = None
    model: str | None = None
    header: bool | None = None


@dataclass(frozen=True)
class Rule:
    """Requests matching every given field are routed as ``deterministic``."""

    deterministic: bool
    api_key: str | None = None
    user: str | None = None
    model: str | None = None
    greedy: bool | None = None
    seeded: bool | None = None

    def matches(self, params: SamplingParams, ctx: RequestContext) -> bool:
        return (
            (self.api_key is None or self.api_key == ctx.api_key)
            and (self.user is None or self.user == ctx.user)
            and (self.model is None or self.model == ctx.model)
            and (self.greedy is None or self.greedy == params.greedy)
            and (self.seeded is None or self.seeded == (params.seed is not None))
        )


@dataclass(frozen=True)
class RouterPolicy:
    rules: tuple[Rule, ...] = ()
    default: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterPolicy:
        known = {f.name for f in fields(Rule)}
        rules = []
        for i, raw in enumerate(data.get("rules", [])):
            unknown = set(raw) - known
            if unknown or "deterministic" not in raw:
                raise ValueError(f"router rule {i}: needs 'deterministic' and only {sorted(known)}; got {sorted(raw)}")
            rules.append(Rule(**raw))
        extra = set(data) - {"rules", "default"}
        if extra:
            raise ValueError(f"router policy: unknown keys {sorted(extra)}")
        return cls(rules=tuple(rules), default=bool(data.get("default", False)))

    @classmethod
    def from_file(cls, path: str | Path) -> RouterPolicy:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read router policy {str(path)!r}: {exc}") from None


@dataclass
class Router:
    policy: RouterPolicy = field(default_factory=RouterPolicy)

    def decide(self, params: SamplingParams, ctx: RequestContext | None = None) -> tuple[bool, str]:
        """(deterministic, why): why is ``field``, ``header``, ``rule:N`` or ``default``."""
        ctx = ctx or RequestContext()
        if params.deterministic is not None:
            return params.deterministic, "field"
        if ctx.header is not None:
            return ctx.header, "header"
        for i, rule in enumerate(self.policy.rules):
            if rule.matches(params, ctx):
                return rule.deterministic, f"rule:{i}"
        return self.policy.default, "default"
