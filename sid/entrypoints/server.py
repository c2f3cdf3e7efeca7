"""The OpenAI-compatible HTTP server: FastAPI routes over the async engine front.

``build_app`` wires an ``LLMEngine`` into a FastAPI app; ``run_server`` serves it with
uvicorn, turning SIGTERM into a drain (no new requests; in-flight ones finish or end
with an error) before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import format_sse_event
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from sid.engine.engine import LLMEngine
from sid.engine.inputs import PromptType
from sid.engine.router import RequestContext
from sid.entrypoints.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, GenerationStream
from sid.entrypoints.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ParamError,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from sid.outputs import PositionLogprobs, RequestOutput
from sid.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DETERMINISTIC_HEADER = "X-Sid-Deterministic"
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_keys: tuple[str, ...] = ()
    receipts: str | Path | None = None
    max_pending: int = 1024
    shutdown_timeout: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM before they end with an error."""

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code or self.status)
        )


@dataclass
class _Delta:
    text: str
    entries: list[tuple[int, PositionLogprobs | None]]
    """(token id, its logprobs) of every token the delta adds."""
    finish_reason: str | None

    def __bool__(self) -> bool:
        return bool(self.text or self.entries or self.finish_reason)


@dataclass
class _Progress:
    """What of one engine request has been sent; turns cumulative outputs into deltas.

    A running request's text may end with the start of a stop string that a later token
    completes and the engine then cuts, so the last ``holdback`` characters wait until the
    request finishes. Every streamed delta thus stays a prefix of the final text.
    """

    holdback: int
    echo: str | None = None
    text_sent: int = 0
    tokens_sent: int = 0
    offset: int = 0
    """``text_offset`` of the next logprob entry."""
    last: RequestOutput | None = None

    def advance(self, out: RequestOutput) -> _Delta:
        c = out.outputs[0]
        end = len(c.text) if out.finished else max(self.text_sent, len(c.text) - self.holdback)
        logprobs = c.logprobs or [None] * len(c.token_ids)
        delta = _Delta(
            c.text[self.text_sent : end],
            list(zip(c.token_ids[self.tokens_sent :], logprobs[self.tokens_sent :])),
            c.finish_reason,
        )
        if self.last is None and self.echo is not None:
            prompt = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            delta.text = self.echo + delta.text
            delta.entries = list(zip(out.prompt_token_ids, prompt)) + delta.entries
        self.text_sent, self.tokens_sent, self.last = end, len(c.token_ids), out
        return delta


def _usage(outputs: Iterable[RequestOutput]) -> Usage:
    outs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def _client_gone(request: Request) -> None:
    """Returns once the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _parse_header_flag(value: str | None) -> bool | None:
    if value is None:
        return None
    flag = {"true": True, "false": False}.get(value.strip().lower())
    if flag is None:
        raise APIError(400, f"{DETERMINISTIC_HEADER} must be 'true' or 'false', got {value!r}", DETERMINISTIC_HEADER)
    return flag


_bearer = HTTPBearer(auto_error=False)


async def request_context(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    x_sid_deterministic: Annotated[str | None, Header()] = None,
) -> RequestContext:
    """Authenticates, and gathers what the router decides on from the headers (API key, flag)."""
    settings: ServerSettings = request.app.state.settings
    key = credentials.credentials if credentials is not None else None
    if settings.api_keys and key not in settings.api_keys:
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    return RequestContext(api_key=key, header=_parse_header_flag(x_sid_deterministic))


Context = Annotated[RequestContext, Depends(request_context)]


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: LLMEngine, front: AsyncEngine, settings: ServerSettings) -> None:
        self.front = front
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.fingerprint = engine.fingerprint
        self.model_path = engine.config.model or ""
        self.max_model_len = engine.max_model_len

    # --------------------------------------------------------------- shared steps

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def submit(
        self, prefix: str, prompts: list[PromptType], params: SamplingParams, ctx: RequestContext, param: str
    ) -> GenerationStream:
        """Hand the prompts to the engine; bad input, overload and shutdown become API errors."""
        try:
            return await self.front.add(f"{prefix}-{uuid.uuid4().hex}", prompts, params, ctx)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from None
        except EngineOverloaded as exc:
            raise APIError(429, f"{exc}; retry later", code="rate_limit_exceeded") from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc)) from None

    async def collect(self, stream: GenerationStream, request: Request) -> list[RequestOutput]:
        """Wait for every output; if the client leaves first, abort the engine requests."""
        final = asyncio.ensure_future(stream.final())
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            done, _ = await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
            if final not in done:  # nobody reads this answer; 499 is what proxies log for it
                raise APIError(499, "the client closed the connection")
            return final.result()
        except EngineUnavailable as exc:
            raise APIError(503, str(exc)) from None
        finally:
            final.cancel()
            gone.cancel()
            if not stream.done:
                self.front.abort(stream)

    def streaming_response(self, stream: GenerationStream, chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
        """SSE: one ``data:`` event per chunk, an error event if the engine gives up, then ``[DONE]``.
        A client that disconnects cancels the generator, which aborts its engine requests."""

        async def events() -> AsyncIterator[bytes]:
            try:
                try:
                    async for chunk in chunks:
                        yield format_sse_event(data_str=chunk.model_dump_json())
                except EngineUnavailable as exc:
                    yield format_sse_event(data_str=APIError(503, str(exc)).body().model_dump_json())
                yield _DONE
            finally:
                if not stream.done:
                    self.front.abort(stream)

        return StreamingResponse(events(), media_type="text/event-stream", headers=self.headers(stream))

    @staticmethod
    def headers(stream: GenerationStream) -> dict[str, str]:
        """Tells the client which path the router chose for it."""
        return {DETERMINISTIC_HEADER: str(stream.deterministic).lower()}

    def json_response(self, body: BaseModel, stream: GenerationStream) -> Response:
        return Response(body.model_dump_json(), media_type="application/json", headers=self.headers(stream))

    def progress(self, params: SamplingParams, echo: str | None = None) -> _Progress:
        return _Progress(holdback=max((len(s) for s in params.stop_strings), default=1) - 1, echo=echo)

    def token_text(self, token_id: int, logprobs: PositionLogprobs | None) -> str:
        entry = logprobs.get(token_id) if logprobs else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    # ---------------------------------------------------------------- completions

    async def completion(self, req: CompletionRequest, ctx: RequestContext, request: Request) -> Response:
        params = req.sampling_params()
        prompts: list[PromptType] = [req.prompt_dict(p) for p in req.prompts()]
        stream = await self.submit("cmpl", prompts, params, ctx, "prompt")
        progress = [self.progress(params, self.echo_text(req, p)) for p in req.prompts()]
        if req.stream:
            return self.streaming_response(stream, self.completion_chunks(req, stream, progress))
        outputs = await self.collect(stream, request)
        choices = [c for i, out in enumerate(outputs) if (c := self.completion_choice(req, i, progress[i], out))]
        body = self.completion_body(stream, choices, _usage(outputs))
        return self.json_response(body, stream)

    def echo_text(self, req: CompletionRequest, prompt: str | list[int]) -> str | None:
        if not req.echo:
            return None
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt) if self.tokenizer is not None else ""

    def completion_body(
        self, stream: GenerationStream, choices: list[CompletionChoice], usage: Usage | None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=stream.id,
            model=self.settings.served_model_name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=usage,
        )

    def completion_choice(
        self, req: CompletionRequest, index: int, progress: _Progress, out: RequestOutput
    ) -> CompletionChoice | None:
        """The choice of what ``out`` adds since the last call; None if it adds nothing."""
        delta = progress.advance(out)
        if not delta:
            return None
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            for token_id, entry in delta.entries:
                token = self.token_text(token_id, entry)
                logprobs.tokens.append(token)
                logprobs.token_logprobs.append(entry[token_id].logprob if entry else None)
                logprobs.top_logprobs.append(
                    {self.token_text(t, entry): lp.logprob for t, lp in entry.items()} if entry else None
                )
                logprobs.text_offset.append(progress.offset)
                progress.offset += len(token)
        return CompletionChoice(
            index=index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=out.outputs[0].stop_reason if delta.finish_reason else None,
        )

    async def completion_chunks(
        self, req: CompletionRequest, stream: GenerationStream, progress: list[_Progress]
    ) -> AsyncIterator[CompletionResponse]:
        async for batch in stream:
            choices = [c for i, out in batch if (c := self.completion_choice(req, i, progress[i], out))]
            if choices:
                yield self.completion_body(stream, choices, None)
        if req.include_usage:
            yield self.completion_body(stream, [], _usage(p.last for p in progress if p.last is not None))

    # ----------------------------------------------------------------------- chat

    def chat_prompt(self, req: ChatCompletionRequest) -> PromptType:
        """The chat template applied to the messages, as token ids (the template adds BOS)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(
                400,
                f"the model {self.settings.served_model_name!r} has no chat template, so it cannot serve "
                "/v1/chat/completions; use /v1/completions with a plain prompt",
                "messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                [m.template_dict() for m in req.messages], add_generation_prompt=True, tokenize=False
            )
        except (TemplateError, TypeError, ValueError) as exc:  # a template may refuse some conversations
            raise APIError(400, f"cannot apply the chat template to these messages: {exc}", "messages") from None
        return req.prompt_dict(self.tokenizer(text, add_special_tokens=False).input_ids)

    async def chat(self, req: ChatCompletionRequest, ctx: RequestContext, request: Request) -> Response:
        params = req.sampling_params()
        stream = await self.submit("chatcmpl", [self.chat_prompt(req)], params, ctx, "messages")
        progress = self.progress(params)
        if req.stream:
            return self.streaming_response(stream, self.chat_chunks(req, stream, progress))
        (out,) = await self.collect(stream, request)
        delta = progress.advance(out)
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=delta.text),
            logprobs=self.chat_logprobs(req, delta),
            finish_reason=delta.finish_reason,
            stop_reason=out.outputs[0].stop_reason,
        )
        body = ChatCompletionResponse(
            id=stream.id,
            model=self.settings.served_model_name,
            system_fingerprint=self.fingerprint,
            choices=[choice],
            usage=_usage([out]),
        )
        return self.json_response(body, stream)

    def chat_logprobs(self, req: ChatCompletionRequest, delta: _Delta) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        top_n = req.top_logprobs or 0
        content = []
        for token_id, entry in delta.entries:
            assert entry is not None
            token = self.token_text(token_id, entry)
            top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= top_n)
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=entry[token_id].logprob,
                    bytes=list(token.encode()),
                    top_logprobs=[
                        TopLogprob(token=(s := self.token_text(t, entry)), logprob=lp, bytes=list(s.encode()))
                        for _, t, lp in top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    async def chat_chunks(
        self, req: ChatCompletionRequest, stream: GenerationStream, progress: _Progress
    ) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=stream.id,
                model=self.settings.served_model_name,
                system_fingerprint=self.fingerprint,
                choices=choices,
                usage=usage,
            )

        async for batch in stream:
            for _, out in batch:
                first = progress.last is None
                delta = progress.advance(out)
                if delta or first:  # the first chunk always goes: it carries the role
                    choice = ChatChunkChoice(
                        index=0,
                        delta=DeltaMessage(role="assistant" if first else None, content=delta.text),
                        logprobs=self.chat_logprobs(req, delta),
                        finish_reason=delta.finish_reason,
                        stop_reason=out.outputs[0].stop_reason if delta.finish_reason else None,
                    )
                    yield chunk([choice])
        if req.include_usage and progress.last is not None:
            yield chunk([], _usage([progress.last]))

    def models(self) -> ModelList:
        name = self.settings.served_model_name
        return ModelList(data=[ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)])


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and stops the engine thread."""
    front = AsyncEngine(engine, max_pending=settings.max_pending, receipts=settings.receipts)
    metrics = front.metrics
    serving = OpenAIServing(engine, front, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        front.start()
        yield
        front.stop()

    app = FastAPI(title="Sid", summary="OpenAI-compatible LLM server with deterministic requests", lifespan=lifespan)
    app.state.front = front
    app.state.settings = settings

    def error_response(exc: APIError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body().model_dump(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ParamError)
    async def _param_error(_: Request, exc: ParamError) -> JSONResponse:
        return error_response(APIError(400, str(exc), exc.param))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        """Pydantic's errors as a 400 naming the first bad field (FastAPI would answer 422)."""
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(
                APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
            )
        where = ".".join(loc)
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        return error_response(APIError(400, f"{where}: {message}" if where else message, loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(APIError(500, f"internal error: {exc}"))

    def routed(ctx: RequestContext, body: CompletionRequest | ChatCompletionRequest) -> RequestContext:
        serving.check_model(body.model)
        return RequestContext(api_key=ctx.api_key, user=body.user, model=settings.served_model_name, header=ctx.header)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, ctx: Context, request: Request) -> Response:
        return await serving.completion(body, routed(ctx, body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, ctx: Context, request: Request) -> Response:
        return await serving.chat(body, routed(ctx, body), request)

    @app.get("/v1/models")
    async def models(_: Context) -> ModelList:
        return serving.models()

    @app.get("/health")
    async def health() -> Response:
        """200 while requests are taken; 503 once the engine failed (a tensor-parallel worker
        that died is seen here at once, even while the engine idles) or the server is draining."""
        if front.error is not None:
            raise APIError(503, f"the engine failed: {front.error}")
        try:
            engine.check_health()
        except RuntimeError as exc:
            raise APIError(503, f"the engine failed: {exc}") from exc
        if not front.alive or front.draining:
            raise APIError(503, "the server is shutting down" if front.draining else "the engine is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, drain the engine (bounded), while uvicorn stops taking connections."""

    def __init__(self, config: uvicorn.Config, front: AsyncEngine, timeout: float) -> None:
        super().__init__(config)
        self.front, self.timeout = front, timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.front.drain(self.timeout)
        super().handle_exit(sig, frame)


def run_server(
    engine: LLMEngine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000, access_log: bool = True
) -> None:
    """Serve until SIGTERM/SIGINT; prints the bound address (``port=0`` picks a free one)."""
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=access_log,
        timeout_graceful_shutdown=int(settings.shutdown_timeout) + 5,
    )
    server = _DrainingServer(config, app.state.front, settings.shutdown_timeout)
    sock = config.bind_socket()
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"sid: serving {settings.served_model_name!r} on http://{bound_host}:{bound_port}", flush=True)
    server.run(sockets=[sock])
