"""The async front of the engine: one thread owns ``LLMEngine``; the event loop only talks to it.

The HTTP side never calls the engine. It posts commands (add, abort, drain, stop) to a
thread-safe inbox; the engine thread takes them between steps, runs ``step()`` whenever
there is work, and hands each step's outputs to the event loop in one
``call_soon_threadsafe`` call. So a slow step never blocks HTTP, and HTTP never races
the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from sid.engine.engine import LLMEngine
from sid.engine.inputs import PromptType
from sid.engine.request import Request
from sid.engine.router import RequestContext
from sid.entrypoints.metrics import EngineSnapshot, RequestTiming, ServerMetrics
from sid.outputs import RequestOutput
from sid.receipts import append_receipt, make_receipt
from sid.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine cannot take or finish this request: it is shutting down or has failed."""


class EngineOverloaded(RuntimeError):
    """More unfinished requests than ``max_pending``: the caller should back off and retry."""


class GenerationStream:
    """The engine requests behind one API request (one per prompt), read as they progress."""

    def __init__(self, request_id: str, num_prompts: int) -> None:
        self.id = request_id
        self.request_ids = [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]
        self.index = {rid: i for i, rid in enumerate(self.request_ids)}
        now = time.monotonic()
        self.timings = [RequestTiming(now) for _ in self.request_ids]
        self.requests: list[Request] = []
        self.unfinished = set(self.request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def done(self) -> bool:
        return not self.unfinished

    @property
    def deterministic(self) -> bool:
        return any(r.deterministic for r in self.requests)

    async def __aiter__(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Yield the latest output of every request that progressed since the last yield.

        Outputs are cumulative, so a slow reader skips intermediate ones instead of
        falling behind; an error from the engine is raised here.
        """
        while not self.done:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            latest: dict[str, RequestOutput] = {}
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                latest[item.request_id] = item
                if item.finished:
                    self.unfinished.discard(item.request_id)
            yield [(self.index[rid], out) for rid, out in latest.items()]

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def final(self) -> list[RequestOutput]:
        """The finished output of every request, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for batch in self:
            finals.update(batch)
        return [finals[i] for i in range(len(self.request_ids))]


@dataclass
class _Add:
    stream: GenerationStream
    prompts: list[PromptType]
    params: SamplingParams
    context: RequestContext
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Drain:
    deadline: float


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _Drain | _Stop
_Delivery = list[tuple[GenerationStream, RequestOutput | BaseException]]


class AsyncEngine:
    """Feeds requests to an ``LLMEngine`` running in its own thread; streams outputs back."""

    def __init__(self, engine: LLMEngine, *, max_pending: int = 1024, receipts: str | Path | None = None) -> None:
        self.engine = engine
        self.metrics = ServerMetrics(self.snapshot)
        self.max_pending = max_pending
        self.receipts = Path(receipts) if receipts else None
        self.error: BaseException | None = None
        self.draining = False
        self._closed = False
        self._snapshot = EngineSnapshot()
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: dict[str, GenerationStream] = {}  # event-loop side: unfinished request -> its stream
        self._owned: dict[str, tuple[Request, GenerationStream]] = {}  # engine-thread side
        self._drain_deadline: float | None = None

    # ------------------------------------------------------------ event loop side

    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sid-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and not self._closed

    def snapshot(self) -> EngineSnapshot:
        return replace(self._snapshot, num_pending=len(self._live))

    async def add(
        self, request_id: str, prompts: list[PromptType], params: SamplingParams, context: RequestContext
    ) -> GenerationStream:
        """Submit one request per prompt (ids ``request_id`` or ``request_id-i``), all or none.

        Raises ``ValueError`` for bad input, ``EngineOverloaded`` or ``EngineUnavailable``
        when it cannot take them now.
        """
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if len(self._live) + len(prompts) > self.max_pending:
            raise EngineOverloaded(f"the server holds {len(self._live)} unfinished requests (limit {self.max_pending})")
        stream = GenerationStream(request_id, len(prompts))
        self._live.update((rid, stream) for rid in stream.request_ids)
        accepted = asyncio.get_running_loop().create_future()
        self._inbox.put(_Add(stream, prompts, params, context, accepted))
        if not self.alive:  # checked after the put: the thread refuses what it finds when it closes
            self._settle(accepted, EngineUnavailable("the engine is not running"))
        try:
            await accepted
        except BaseException:  # rejected, or the caller went away while it was queued
            self._forget(stream)
            self._inbox.put(_Abort(stream.request_ids))
            raise
        return stream

    def abort(self, stream: GenerationStream) -> None:
        """Stop the stream's unfinished requests and free their KV blocks (the client went away)."""
        ids = self._forget(stream)
        if ids:
            self.metrics.requests.labels("abort").inc(len(ids))
            self._inbox.put(_Abort(ids))

    def drain(self, timeout: float) -> None:
        """Refuse new requests; give in-flight ones ``timeout`` seconds, then end them with an error."""
        self.draining = True
        self._inbox.put(_Drain(time.monotonic() + timeout))

    def stop(self) -> None:
        """End the engine thread, erroring whatever is still running."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join()

    def _forget(self, stream: GenerationStream) -> list[str]:
        ids = [rid for rid in stream.request_ids if self._live.get(rid) is stream]
        for rid in ids:
            del self._live[rid]
        return ids

    def _deliver(self, items: _Delivery, made_at: float) -> None:
        for stream, item in items:
            if isinstance(item, BaseException):
                self.metrics.requests.labels("error").inc(len(self._forget(stream)))
            elif self._live.get(item.request_id) is not stream:
                continue  # aborted meanwhile
            else:
                self.metrics.observe(stream.timings[stream.index[item.request_id]], item, made_at)
                if item.finished:
                    del self._live[item.request_id]
            stream.put(item)

    @staticmethod
    def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # -------------------------------------------------------------- engine thread

    def _post(self, items: _Delivery) -> None:
        if items:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, items, time.monotonic())

    def _run(self) -> None:
        shut_down = EngineUnavailable("the server shut down before the request finished")
        try:
            self._take_snapshot()
            while self._handle(self._take_commands(block=not self.engine.has_unfinished_requests())):
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._fail_all(shut_down)
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                self._take_snapshot()
            self._fail_all(shut_down)
        except Exception as exc:  # the engine is broken: every waiting client gets the error
            logger.exception("the engine thread failed")
            self.error = exc
            self._post([(stream, EngineUnavailable(f"the engine failed: {exc}")) for stream in self._streams()])
        finally:
            self._closed = True
            for command in self._take_commands(block=False):
                if isinstance(command, _Add):
                    self._reply(command, EngineUnavailable("the engine is not running"))

    def _take_snapshot(self) -> None:
        """Publish the engine's counters for /metrics (a new object, so readers never see a torn one)."""
        scheduler = self.engine.scheduler
        self._snapshot = EngineSnapshot(self.engine.get_stats(), len(scheduler.running), len(scheduler.waiting))

    def _take_commands(self, block: bool) -> list[_Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, commands: list[_Command]) -> bool:
        """Apply commands in order; False once asked to stop."""
        for command in commands:
            if isinstance(command, _Add):
                self._reply(command, self._accept(command))
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_ids)
                for rid in command.request_ids:
                    self._owned.pop(rid, None)
            elif isinstance(command, _Drain):
                self._drain_deadline = command.deadline
            else:
                return False
        return True

    def _reply(self, command: _Add, error: Exception | None) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._settle, command.accepted, error)

    def _accept(self, command: _Add) -> Exception | None:
        """Validate every prompt, then enqueue them all; the error of the first bad one otherwise."""
        if self._drain_deadline is not None:
            return EngineUnavailable("the server is shutting down")
        requests = []
        for i, (rid, prompt) in enumerate(zip(command.stream.request_ids, command.prompts)):
            try:
                requests.append(self.engine.make_request(rid, prompt, command.params, command.context))
            except ValueError as exc:
                return ValueError(f"prompt {i}: {exc}") if len(command.prompts) > 1 else exc
        command.stream.requests = requests
        for request in requests:
            self.engine.enqueue(request)
            self._owned[request.request_id] = (request, command.stream)
        return None

    def _publish(self, outputs: list[RequestOutput]) -> None:
        items: _Delivery = []
        receipts = []
        for out in outputs:
            owned = self._owned.get(out.request_id)
            if owned is None:
                continue
            request, stream = owned
            items.append((stream, out))
            if out.finished:
                del self._owned[out.request_id]
                if out.deterministic and self.receipts is not None:
                    receipts.append(make_receipt(out, request.params, request.seed, self.engine.config.model or ""))
        self._post(items)  # answer first: a receipt that cannot be written must not strand a client
        for receipt in receipts:
            try:
                append_receipt(self.receipts, receipt)  # type: ignore[arg-type]
            except OSError:  # nor stop the engine: the response went out, its receipt is lost
                logger.exception("could not write the receipt of %s to %s", receipt["request_id"], self.receipts)

    def _streams(self) -> list[GenerationStream]:
        return list({id(stream): stream for _, stream in self._owned.values()}.values())

    def _fail_all(self, error: Exception) -> None:
        """Abort every request still in the engine; each stream gets ``error``."""
        if self._owned:
            self.engine.abort_request(list(self._owned))
            streams = self._streams()
            self._owned.clear()
            self._post([(stream, error) for stream in streams])
