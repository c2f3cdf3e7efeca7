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
    _fed: int = 0

    def __post_init__(self) -> None:
        # Start the window inside the prompt so the first output token decodes in context.
        self._ids = self.prompt_token_ids[-_WINDOW:]
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def sync(self, output_token_ids: list[int]) -> str | None:
        """Feed the output tokens not seen yet; return the stop string if one now appears.

        Callers may feed every token as it comes (streaming, stop strings) or catch up once
        when the text is needed: the text is the same either way.
        """
        new = output_token_ids[self._fed :]
        self._fed = len(output_token_ids)
        if not new:
            return None
        checked_from = max(len(self.text) - max((len(s) for s in self.stop_strings), default=0) + 1, 0)
        # All but the last few tokens in one decode; the tail token by token, so an
        # incomplete character at the very end holds back only itself.
        head, tail = new[:-_WINDOW], new[-_WINDOW:]
        for piece in ([head] if head else []) + [[t] for t in tail]:
            self._ids.extend(piece)
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
