"""A step whose passes are launched and whose results are still to be read (overlapped scheduling).

With overlapped scheduling the engine launches step N+1 before reading step N's results. The
requests' counters run ahead meanwhile, and a rollback or preemption since the launch voids
what a pass computed: each chunk remembers the request's epoch at launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sid.runtime.model_runner import LaunchedPass, TokenFeed


@dataclass(frozen=True)
class Planned:
    """A launched chunk's request as it was: its epoch, and whether a placeholder awaits the
    chunk's last token."""

    epoch: int
    takes_token: bool


@dataclass
class StepInFlight:
    """One step's launched passes, in launch order, with the request epochs they ran under."""

    step: int
    passes: list[LaunchedPass] = field(default_factory=list)
    planned: list[list[Planned]] = field(default_factory=list)  # per pass, per chunk

    @property
    def tokens(self) -> list[torch.Tensor]:
        return [p.tokens for p in self.passes if p.tokens is not None]

    @property
    def num_tokens(self) -> int:
        """Rows sampled so far: where the next pass's tokens start in ``feed``."""
        return sum(t.numel() for t in self.tokens)

    def add(self, handle: LaunchedPass, planned: list[Planned]) -> None:
        self.passes.append(handle)
        self.planned.append(planned)

    def feed(self) -> TokenFeed | None:
        """Every pass's sampled tokens, on the device, for the next step's placeholders."""
        tokens = self.tokens
        if not tokens:
            return None
        return TokenFeed(tokens[0] if len(tokens) == 1 else torch.cat(tokens), self.step)
