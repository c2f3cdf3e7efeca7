"""Incremental detokenization and stop strings.

Decoding a whole sequence on every token costs quadratic time; instead each step decodes
a short window starting a few tokens back (vLLM's prefix/read offsets), so tokenizers
that merge or strip across token boundaries still produce the right text. Text ending in
an incomplete UTF-8 character is held back until the character completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

_WINDOW = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    prompt_token_ids: list[int]
    skip_special_tokens: bool
    stop_strings: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        # Start the window inside the prompt so the first output token decodes in context.
        self._ids = self.prompt_token_ids[-_WINDOW:]
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears in the text."""
        checked_from = max(len(self.text) - max((len(s) for s in self.stop_strings), default=0) + 1, 0)
        for tok in new_token_ids:
            self._ids.append(tok)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        for stop in self.stop_strings:
            idx = self.text.find(stop, checked_from)
            if idx != -1:
                self.text = self.text[: idx + len(stop) if self.include_stop_str_in_output else idx]
                return stop
        return None
