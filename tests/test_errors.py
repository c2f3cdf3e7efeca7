"""Bad input gets a clear ValueError, and nothing already running is disturbed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sid import LLM, SamplingParams
from sid.model.config import CheckpointError


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=2), "n=2"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_max_tokens_zero_is_allowed_for_scoring(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=32)
    out = llm.generate("def main(", SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.finished
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None


@pytest.fixture(scope="module")
def llm(trained_model: Path) -> LLM:
    return LLM(str(trained_model), num_kv_blocks=16, max_model_len=64)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ([1, 2, 8192], "outside the vocabulary"),
        ([1, -1], "outside the vocabulary"),
        (list(range(1, 80)), "max_model_len"),
        ({"text": "x"}, "'prompt' or 'prompt_token_ids'"),
        (3.5, "unsupported prompt type"),
    ],
)
def test_bad_prompts_raise_naming_the_problem(llm: LLM, prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)  # type: ignore[arg-type]


def test_generate_validates_everything_first_and_names_the_index(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 2: .*outside the vocabulary"):
        llm.generate(["def a(", "def b(", [1, 99999]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_request_larger_than_the_kv_pool_is_rejected(llm: LLM) -> None:
    engine = LLM(llm.llm_engine.config.model, num_kv_blocks=2).llm_engine  # 32 token slots
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        engine.add_request("x", list(range(1, 30)), SamplingParams(max_tokens=4))
    engine.add_request("y", list(range(1, 30)), SamplingParams(max_tokens=3))


def test_add_request_rejects_bad_requests_without_disturbing_running_ones(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate("def main(", params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", "def main(", params)
    engine.step()
    for rid, prompt, p in [
        ("bad1", [1, 99999], params),
        ("bad2", "", params),
        ("good", "def f(", params),  # duplicate id
        ("bad3", "x", "greedy"),
    ]:
        with pytest.raises(ValueError):
            engine.add_request(rid, prompt, p)  # type: ignore[arg-type]
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.request_id == "good" and final.outputs[0].token_ids == alone


def test_engine_options_are_checked() -> None:
    from sid.config import EngineConfig

    for kwargs, match in [
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(dtype="int8"), "dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="x", **kwargs).torch_dtype(torch.device("cpu"))


def test_max_model_len_above_the_model_limit(trained_model: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        LLM(str(trained_model), max_model_len=100_000)


# ------------------------------------------------------------------ broken checkpoints


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(checkpoints["llama"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(path))


def test_missing_and_misshapen_weights_are_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = checkpoints["llama"]
    weights = load_file(str(src / "model.safetensors"))
    missing = copy_model(src, tmp_path / "missing")
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(missing))
    bad = copy_model(src, tmp_path / "bad")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight .*\(7, 64\).*\(32, 64\)"):
        LLM(str(bad))


def test_corrupt_or_absent_weight_files(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    corrupt = copy_model(checkpoints["qwen2"], tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read weight file"):
        LLM(str(corrupt))
    empty = copy_model(checkpoints["qwen2"], tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(str(empty))
