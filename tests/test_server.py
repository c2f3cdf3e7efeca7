"""The OpenAI-compatible server, driven over real HTTP with the official ``openai`` client.

One engine serves the module from a uvicorn thread (fast-lane faults can be switched on
in-process), with overlapped scheduling as on a GPU; a `sid serve` subprocess (lockstep,
the CPU default) covers the command line, capacity, a model without a chat template, and
SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion

from sid.config import EngineConfig
from sid.engine.engine import LLMEngine
from sid.entrypoints import cli
from sid.entrypoints.server import ServerSettings, build_app
from sid.model.builtin import CHAT_TEMPLATE, write_checkpoint
from sid.runtime.faults import FAULTS
from tests.server_utils import ServeProcess, ServerThread, poll_metrics, scrape, with_chat_template

MODEL = "tiny-pycode"
KEY = "sk-test"
PROMPT = "def fibonacci(n):\n"
CROWD = ["import os\n", "class Node:\n    def __init__(self", "x = [", "# utils\n" * 12, "    for i in range("]


class Served:
    def __init__(self, url: str, model_path: Path, receipts: Path, engine: LLMEngine) -> None:
        self.url, self.model_path, self.receipts, self.engine = url, model_path, receipts, engine
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body: object = None, content: str | None = None, **headers: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **headers}
        return httpx.post(f"{self.url}{path}", json=body, content=content, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def served(trained_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("server")
    model = with_chat_template(trained_model, tmp / "model", CHAT_TEMPLATE)
    policy = tmp / "router.json"
    policy.write_text(json.dumps({"rules": [{"user": "auditor", "deterministic": True}]}))
    receipts = tmp / "receipts.jsonl"
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=512, router_policy=str(policy), async_scheduling=True)
    )
    settings = ServerSettings(served_model_name=MODEL, api_keys=(KEY, "sk-other"), receipts=receipts)
    with ServerThread(build_app(engine, settings)) as server:
        yield Served(server.url, model, receipts, engine)


@pytest.fixture(scope="module")
def cli_server(trained_model: Path) -> Iterator[ServeProcess]:
    """`sid serve` on the trained model as shipped (no chat template), at most 2 unfinished requests."""
    server = ServeProcess(str(trained_model), "--num-kv-blocks", "256", "--max-pending", "2", "--shutdown-timeout", "2")
    yield server
    server.stop()


def complete(served: Served, prompt: str | list = PROMPT, max_tokens: int = 16, **extra: object) -> Completion:
    return served.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra}
    )


def stream_text(served: Served, **kwargs: object) -> tuple[str, list[object]]:
    chunks = list(served.client.completions.create(model=MODEL, stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# ------------------------------------------------------------------ the basics


def test_models_health_and_fingerprint(served: Served) -> None:
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    assert httpx.get(f"{served.url}/health").status_code == 200
    out = complete(served, max_tokens=8)
    assert out.system_fingerprint == served.engine.fingerprint and out.system_fingerprint.startswith("fp_")
    assert out.usage.prompt_tokens == len(served.engine.tokenizer(PROMPT).input_ids)
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert out.choices[0].finish_reason == "length" and out.choices[0].text


def test_chat_uses_the_template_once(served: Served) -> None:
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "a fibonacci function"}]
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    text = served.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.usage.prompt_tokens == len(served.engine.tokenizer(text, add_special_tokens=False).input_ids)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.completion_tokens == 8 and out.system_fingerprint == served.engine.fingerprint
    parts = [{"role": "user", "content": [{"type": "text", "text": "a fibonacci function"}]}]
    same = served.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    plain = served.client.chat.completions.create(model=MODEL, messages=[messages[1]], max_tokens=8, temperature=0)
    assert same.choices[0].message.content == plain.choices[0].message.content


def test_streaming_equals_non_streaming(served: Served) -> None:
    for extra in ({}, {"deterministic": True}):
        whole = complete(served, max_tokens=20, logprobs=1, **extra)
        text, chunks = stream_text(
            served,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            logprobs=1,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **extra},
        )
        assert text == whole.choices[0].text
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert tokens == whole.choices[0].logprobs.tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
        assert {c.system_fingerprint for c in chunks} == {whole.system_fingerprint}
    messages = [{"role": "user", "content": "sort a list"}]
    whole = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_string_split_across_tokens_is_never_streamed(served: Served) -> None:
    full = complete(served, max_tokens=24, logprobs=0).choices[0]
    tokens, offsets = full.logprobs.tokens, full.logprobs.text_offset
    # A stop string made of one token's last character and the next token's first: the
    # engine only sees it complete one token after its first half was generated.
    stop = next(
        s
        for i in range(2, len(tokens) - 1)
        if tokens[i] and tokens[i + 1] and full.text.find(s := tokens[i][-1] + tokens[i + 1][0]) == offsets[i + 1] - 1
    )
    cut = complete(served, max_tokens=24, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    text, _ = stream_text(
        served, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert text == cut.text


def test_seed_reproduces_a_sample(served: Served) -> None:
    def sample(seed: int) -> str:
        return (
            served.client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_and_echo_scoring(served: Served) -> None:
    out = complete(served, max_tokens=6, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 and "".join(lp.tokens) == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and logprob <= 0 and logprob == max(top.values()) == top[token]  # greedy: the best

    ids = served.engine.tokenizer(PROMPT).input_ids
    scored = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert all(x < 0 for x in choice.logprobs.token_logprobs[1:])
    by_ids = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert by_ids.logprobs.token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    echoed = complete(served, max_tokens=4, echo=True, logprobs=1).choices[0]
    assert echoed.text.startswith(PROMPT) and len(echoed.logprobs.tokens) == len(ids) + 4
    assert echoed.logprobs.token_logprobs[: len(ids)] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)

    chat = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)


def test_batched_prompts_are_separate_choices(served: Served) -> None:
    prompts = [PROMPT, CROWD[1]]
    batch = complete(served, prompts, max_tokens=10, deterministic=True)
    assert [c.index for c in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices):
        assert choice.text == complete(served, prompt, max_tokens=10, deterministic=True).choices[0].text
    assert batch.usage.completion_tokens == 20


# ------------------------------------------------------------------ determinism


def test_deterministic_requests_identical_under_load_on_every_router_path(served: Served, monkeypatch) -> None:
    """Field, header and a rule on `user` each route to the deterministic path (rows riding
    beside the others); under concurrent random traffic and fast-lane faults every one equals
    the unperturbed alone run."""
    reference = complete(served, max_tokens=24, logprobs=1, deterministic=True)
    monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 3.0)
    rng = random.Random(0)

    async def target(client: openai.AsyncOpenAI, how: str) -> tuple[str, Completion]:
        kwargs: dict = {"extra_body": {"ignore_eos": True}}
        if how == "field":
            kwargs["extra_body"]["deterministic"] = True
        elif how == "header":
            kwargs["extra_headers"] = {"X-Sid-Deterministic": "true"}
        else:
            kwargs["user"] = "auditor"
        await asyncio.sleep(rng.random() * 0.3)
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, **kwargs
        )
        return raw.headers["X-Sid-Deterministic"], raw.parse()

    async def crowd(client: openai.AsyncOpenAI, i: int) -> None:
        await client.completions.create(
            model=MODEL,
            prompt=CROWD[i % len(CROWD)],
            max_tokens=8 + 3 * i,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )

    async def main() -> list:
        async with served.aclient() as client:
            paths = ["field", "header", "rule"] * 2
            results = await asyncio.gather(*(target(client, p) for p in paths), *(crowd(client, i) for i in range(12)))
        return results[: len(paths)]

    for header, out in asyncio.run(main()):
        assert header == "true"
        assert out.choices[0].text == reference.choices[0].text
        assert out.choices[0].logprobs.token_logprobs == reference.choices[0].logprobs.token_logprobs  # bits
        assert out.system_fingerprint == reference.system_fingerprint
    normal = complete(served, max_tokens=24)
    assert normal.choices[0].text != reference.choices[0].text  # the faults do reach the fast lane
    samples = scrape(served.url)
    assert samples['sid_strategy_choices_total{strategy="ride"}'] > 0 and samples["sid_rollbacks_total"] == 0


@pytest.mark.parametrize(
    ("body", "header", "expected"),
    [
        ({"deterministic": False}, "true", "false"),  # the field beats the header
        ({"user": "auditor"}, "false", "false"),  # the header beats the rule
        ({"user": "auditor"}, None, "true"),  # the rule beats the default
        ({"user": "someone"}, None, "false"),  # the default: off
    ],
)
def test_router_precedence(served: Served, body: dict, header: str | None, expected: str) -> None:
    headers = {"X-Sid-Deterministic": header} if header else {}
    r = served.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **body}, **headers)
    assert r.status_code == 200 and r.headers["X-Sid-Deterministic"] == expected


def receipts_through(served: Served, request_id: str, timeout: float = 30) -> list[dict]:
    """The receipts file once it holds ``request_id``'s receipt: the server answers before it
    writes the receipt, so a client can read the file a moment too early."""
    deadline = time.monotonic() + timeout
    while True:
        lines = served.receipts.read_text().split("\n")[:-1]  # a line still being written has no newline
        records = [json.loads(line) for line in lines]
        if any(r["request_id"] == request_id for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def test_receipts_replay(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    sampled = complete(served, max_tokens=12, deterministic=True, temperature=0.8)
    records = receipts_through(served, sampled.id)
    (mine,) = [r for r in records if r["request_id"] == sampled.id]
    assert mine["num_output_tokens"] == 12 and mine["params"]["seed"] == 0
    assert all(r["fingerprint"] == sampled.system_fingerprint for r in records)
    assert {r["params"]["deterministic"] for r in records} == {True}  # field, header and rule alike
    # One receipt per distinct request keeps the replay short; identical ones replay identically.
    distinct = {json.dumps([r["prompt_token_ids"], r["params"]]): r for r in records}
    path = served.receipts.with_name("distinct.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in distinct.values()))
    capsys.readouterr()
    assert cli.main(["replay", str(path), "--model", str(served.model_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("MATCH") == len(distinct) and "MISMATCH" not in printed


# ------------------------------------------------------------------ hard edges


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "stop": 5}, "stop"),
        ({"prompt": PROMPT, "n": 2}, "n"),
        ({"prompt": PROMPT, "best_of": 3}, "best_of"),
        ({"prompt": PROMPT, "logit_bias": {"17": 5}}, "logit_bias"),
        ({"prompt": PROMPT, "logprobs": 99}, "logprobs"),
        ({"prompt": PROMPT, "max_tokens": 0}, None),
        ({"prompt": "x " * 3000}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(served: Served, body: dict, param: str | None) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = served.post(path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    if param is None:
        assert "max_tokens" in error["message"]


def test_malformed_json_unknown_model_extra_fields_and_header(served: Served) -> None:
    r = served.post("/v1/completions", content='{"prompt": "x",', **{"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        served.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    ok = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"frobnicate": [1]})
    assert ok.usage.completion_tokens == 2
    r = served.post("/v1/completions", {"model": MODEL, "prompt": PROMPT}, **{"X-Sid-Deterministic": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Sid-Deterministic"
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        served.client.completions.create(model=MODEL, prompt="x " * 3000, max_tokens=2)


def test_api_keys(served: Served) -> None:
    for key in ("wrong", KEY + "x"):
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert httpx.post(f"{served.url}/v1/completions", json={"prompt": PROMPT}).status_code == 401
    assert httpx.get(f"{served.url}/v1/models").status_code == 401
    other = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-other", max_retries=0)
    assert other.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_disconnect_aborts_and_frees_kv_blocks(served: Served) -> None:
    aborted = scrape(served.url).get('sid_requests_total{finish_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = scrape(served.url)
        assert busy["sid_num_requests_running"] == 1 and busy["sid_kv_cache_usage"] > 0
    poll_metrics(served.url, lambda m: m["sid_num_requests_running"] == 0 and m["sid_kv_cache_usage"] == 0)

    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    after = poll_metrics(
        served.url,
        lambda m: (
            m["sid_num_requests_pending"] == 0
            and m["sid_kv_cache_usage"] == 0
            and m.get('sid_requests_total{finish_reason="abort"}', 0) == aborted + 2
        ),
    )
    assert after["sid_num_requests_running"] == 0


def test_load_64_concurrent_streams_in_waves(served: Served) -> None:
    """Every stream of two waves of 64 arrives whole: [DONE], finish reason, every token."""
    rng = random.Random(1)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str, int, str | None, int]:
        prompt, max_tokens, deterministic = CROWD[i % len(CROWD)], rng.randint(4, 16), i % 4 == 0
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0 if deterministic else 1.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "deterministic": deterministic},
        )
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return prompt, max_tokens, text if deterministic else "", usage, finish, deterministic

    async def main() -> list:
        async with served.aclient() as client:
            results = []
            for wave in range(2):
                results += await asyncio.gather(*(one(client, 64 * wave + i) for i in range(64)))
        return results

    start = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == 128
    for prompt, max_tokens, _, usage, finish, _ in results:
        assert finish == "length" and usage == max_tokens, (prompt, max_tokens, usage, finish)
    texts: dict[tuple[str, int], set[str]] = {}
    for prompt, max_tokens, text, _, _, deterministic in results:
        if deterministic:
            texts.setdefault((prompt, max_tokens), set()).add(text)
    assert all(len(v) == 1 for v in texts.values())
    final = poll_metrics(served.url, lambda m: m["sid_num_requests_pending"] == 0)
    assert final["sid_kv_cache_usage"] == 0 and time.monotonic() - start < 120


def test_metrics_report_latency_and_determinism(served: Served) -> None:
    complete(served, max_tokens=4, deterministic=True)
    m = scrape(served.url)
    for name in (
        "sid_time_to_first_token_seconds_count",
        "sid_time_per_output_token_seconds_count",
        "sid_inter_token_latency_seconds_count",
        "sid_e2e_request_latency_seconds_count",
        "sid_generation_tokens_total",
        "sid_prompt_tokens_total",
        "sid_deterministic_requests_total",
        'sid_strategy_choices_total{strategy="ride"}',
        'sid_requests_total{finish_reason="length"}',
    ):
        assert m[name] > 0, name
    assert m["sid_verifications_total"] == m["sid_canonical_lane_fill"] == 0  # riding rows need no canonical pass
    assert m[f'sid_numerics_info{{fingerprint="{served.engine.fingerprint}"}}'] == 1
    for name in (
        "sid_num_requests_waiting",
        "sid_kv_cache_usage",
        "sid_prefix_cache_hit_rate",
        "sid_recomputed_tokens_total",
    ):
        assert name in m


def test_dead_engine_answers_503(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "tiny", "LlamaForCausalLM")
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, enable_determinism=False))

    def broken_step() -> list:
        raise RuntimeError("device lost")

    engine.step = broken_step  # type: ignore[method-assign]
    with ServerThread(build_app(engine, ServerSettings(served_model_name="tiny"))) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x = 1", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x = 1", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503


def test_a_receipt_that_cannot_be_written_loses_no_response(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The receipts path is a directory: each deterministic response still arrives, the
    failure is logged, and the engine keeps serving."""
    path = write_checkpoint(tmp_path / "tiny", "LlamaForCausalLM")
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
    settings = ServerSettings(served_model_name="tiny", receipts=tmp_path)
    body = {"prompt": "x = 1", "max_tokens": 4, "deterministic": True, "ignore_eos": True}
    with ServerThread(build_app(engine, settings)) as server:
        for _ in range(2):
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{server.url}/health").status_code == 200
    assert "could not write the receipt" in caplog.text


def test_dead_tp_worker_shows_in_health_while_the_server_stays_up(checkpoints: dict[str, Path]) -> None:
    """A worker killed while the engine idles: /health says so at once, naming it; the server
    keeps answering, and a request gets a 503 with the same cause."""
    config = EngineConfig(
        model=str(checkpoints["qwen3"]), tensor_parallel_size=2, device="cpu", num_kv_blocks=64,
        enable_determinism=False, load_format="dummy",
    )
    engine = LLMEngine(config)
    try:
        with ServerThread(build_app(engine, ServerSettings(served_model_name="tiny"))) as server:
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x = 1", "max_tokens": 4}, timeout=30)
            assert r.status_code == 200 and httpx.get(f"{server.url}/health").status_code == 200
            os.kill(engine.workers.pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 5
            while (health := httpx.get(f"{server.url}/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health did not see the dead worker within 5 s"
                time.sleep(0.05)
            assert health.status_code == 503
            assert r"worker rank 1 died (exit code -9)" in health.json()["error"]["message"]
            assert httpx.get(f"{server.url}/v1/models").status_code == 200
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x = 1", "max_tokens": 4}, timeout=30)
            assert r.status_code == 503 and "rank 1 died" in r.json()["error"]["message"]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ `sid serve`


def test_cli_server_without_chat_template_says_so(cli_server: ServeProcess, trained_model: Path) -> None:
    client = openai.OpenAI(base_url=f"{cli_server.url}/v1", api_key="none", max_retries=0)
    assert client.models.list().data[0].id == str(trained_model)  # served name: the path as given
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=str(trained_model), messages=[{"role": "user", "content": "hi"}])


def test_cli_server_over_capacity_answers_429(cli_server: ServeProcess, trained_model: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    client = openai.OpenAI(base_url=f"{cli_server.url}/v1", api_key="none", max_retries=0)
    with (
        httpx.Client(base_url=cli_server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as a,
        http.stream("POST", "/v1/completions", json=body) as b,
    ):
        streams = a.iter_lines(), b.iter_lines()  # kept: a dropped iterator closes its connection
        assert all(next(lines).startswith("data: ") for lines in streams)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=str(trained_model), prompt=PROMPT, max_tokens=2)
    poll_metrics(cli_server.url, lambda m: m["sid_num_requests_pending"] == 0)
    assert client.completions.create(model=str(trained_model), prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_cli_server_sigterm_finishes_or_errors_in_flight(cli_server: ServeProcess) -> None:
    """After SIGTERM a short request still finishes; a long one gets an error event, then [DONE]."""
    short = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": True}
    long = {**short, "max_tokens": 1000}
    with (
        httpx.Client(base_url=cli_server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=long) as a,
        http.stream("POST", "/v1/completions", json=short) as b,
    ):
        long_lines, short_lines = a.iter_lines(), b.iter_lines()
        assert next(long_lines).startswith("data: ") and next(short_lines).startswith("data: ")
        cli_server.proc.send_signal(signal.SIGTERM)
        short_events = [line for line in short_lines if line]
        long_events = [line for line in long_lines if line]
    assert short_events[-1] == "data: [DONE]"
    assert json.loads(short_events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "data: [DONE]"
    error = json.loads(long_events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "shut down" in error["message"]
    assert cli_server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
