"""Incremental detokenization: token by token or caught up at once, the text is the same."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from sid.engine.detokenizer import IncrementalDetokenizer

TEXT = "def café(x):\n    return '🙂 naïve ' + x  # ünïcode 漢字\n"


def test_sync_one_by_one_equals_catch_up_and_full_decode(trained_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(trained_model))
    prompt = tok("print(").input_ids
    ids = tok(TEXT, add_special_tokens=False).input_ids
    one = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    texts = []
    for i in range(1, len(ids) + 1):
        one.sync(ids[:i])
        texts.append(one.text)
        assert "\ufffd" not in one.text  # incomplete characters are held back, never shown
    batch = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    batch.sync(ids)
    assert one.text == batch.text == TEXT
    assert all(texts[i].startswith(texts[i - 1]) for i in range(1, len(texts)))  # text only grows


def test_stop_string_found_across_tokens(trained_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(trained_model))
    ids = tok(TEXT, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, [1], skip_special_tokens=True, stop_strings=("return '",))
    found = next((i, s) for i in range(1, len(ids) + 1) if (s := d.sync(ids[:i])) is not None)
    assert found[1] == "return '" and tok.decode(ids[: found[0]]).endswith("return '")
    assert d.text == "def café(x):\n    "
