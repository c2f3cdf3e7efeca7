"""Bad input gets a clear ValueError, and nothing already running is disturbed."""

from __future__ import annotations

import json
import re
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
        (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\], got 21"),
        (dict(prompt_logprobs=8193), "prompt_logprobs must be an integer in"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1, got 0"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1, got 0"),
        (dict(block_size=0), "block_size must be >= 1, got 0"),
        (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1, got 0"),
        (dict(cpu_kv_cache_bytes=-5), "cpu_kv_cache_bytes must be >= 1, got -5"),
        (dict(tp_invariant_chunks=6), "tp_invariant_chunks must be a power of two, got 6"),
        (dict(tp_invariant_chunks=2, tensor_parallel_size=4), "tp_invariant_chunks=2 needs a tensor_parallel_size"),
        (dict(collective_timeout_s=0), "collective_timeout_s must be > 0, got 0"),
        (dict(collective_timeout_s=float("nan")), "collective_timeout_s must be > 0, got nan"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be in"),
        (dict(max_model_len=1), "max_model_len must be >= 2, got 1"),
        (dict(verify_window=0), "verify_window must be >= 1, got 0"),
    ],
)
def test_engine_settings_out_of_range_are_named(kwargs: dict, match: str) -> None:
    from sid.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(model="x", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dtype="int8"), "unknown dtype 'int8'"),
        (dict(device="bogus"), "device='bogus' is not a device: use auto, cpu, cuda or cuda:N"),
        (dict(device="meta"), "device='meta': Sid runs on cpu or cuda"),
        (dict(device="cuda"), "no CUDA device is available"),
        (dict(load_format="npz"), "unknown load_format 'npz'"),
        (dict(attention_backend="flash"), "unknown attention backend 'flash'"),
        (dict(determinism_strategy="fastest"), "unknown determinism strategy 'fastest'"),
    ],
)
def test_engine_settings_with_choices_are_named(
    trained_model: Path, kwargs: dict, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=match):
        LLM(str(trained_model), **kwargs)


def test_devices_the_engine_cannot_run_on_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import sid.config
    from sid.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(sid.config, "HAS_TRITON", True)
    assert EngineConfig(device="cuda:1").torch_device() == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device='cuda:2': this machine has 2 CUDA device\(s\)"):
        EngineConfig(device="cuda:2").torch_device()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend='triton' on the CPU runs only in Triton's interpreter"):
        EngineConfig(device="cpu", attention_backend="triton").torch_device()
    monkeypatch.setattr(sid.config, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="attention_backend='triton' needs Triton, and it is not installed"):
        EngineConfig(attention_backend="triton")


def test_logprobs_beyond_the_vocabulary_no_longer_reach_the_engine(llm: LLM) -> None:
    """They used to pass validation, fail in torch.topk mid-step, and leave the engine failing every step."""
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        llm.generate("def main(", SamplingParams(max_tokens=2, logprobs=10_000), use_tqdm=False)
    out = llm.generate("def main(", SamplingParams(max_tokens=2, temperature=0, logprobs=20), use_tqdm=False)[0]
    assert all(len(position) >= 20 for position in out.outputs[0].logprobs)


def test_server_settings_out_of_range_are_named() -> None:
    from sid.entrypoints.server import ServerSettings

    with pytest.raises(ValueError, match="max_pending must be >= 1, got 0"):
        ServerSettings(served_model_name="m", max_pending=0)
    with pytest.raises(ValueError, match="shutdown_timeout must be >= 0, got -1"):
        ServerSettings(served_model_name="m", shutdown_timeout=-1)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["serve", "--port", "70000"], r"argument --port: must be in \[0, 65535\], got 70000"),
        (["serve", "--max-pending", "0"], "argument --max-pending: must be >= 1, got 0"),
        (["serve", "--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be >= 0, got -1"),
        (["repro", "--trials", "0"], "argument --trials: must be >= 1, got 0"),
        (["repro", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
        (["repro", "--long-prompt", "1"], "argument --long-prompt: must be >= 2, got 1"),
        (["repro", "--sampled-temperature", "nan"], "argument --sampled-temperature: must be >= 0, got nan"),
        (["repro", "--sampled-seed", "-1"], "argument --sampled-seed: must be in"),
        (["repro", "--trials", "x"], "argument --trials: invalid int value: 'x'"),
    ],
)
def test_cli_options_out_of_range_are_named(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sid.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_repro_refuses_a_model_length_its_co_tenants_do_not_fit(trained_model: Path) -> None:
    from sid.repro import Repro

    engine = LLM(str(trained_model), num_kv_blocks=64, max_model_len=64).llm_engine
    with pytest.raises(ValueError, match="the repro's co-tenants need max_model_len >= 76, got 64"):
        Repro(engine, max_tokens=8, trials=1, long_prompt=384, prompt=None)


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
    save_file(
        {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
        str(missing / "model.safetensors")
    )
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
