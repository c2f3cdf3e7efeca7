"""Tensor-parallel worker processes (ranks 1..N-1) and rank 0's handle on them.

The engine process is rank 0: it schedules, samples, and drives the workers. Each worker
is a fresh interpreter running ``worker_main``: never forked, so no CUDA state is
inherited, and unlike ``multiprocessing``'s spawn it never re-runs the user's main script
(scripts need no ``if __name__ == "__main__"`` guard). It reads its ``WorkerSpec`` from
the store, builds its own shard of the model and its own KV cache (its KV heads; the
block count rank 0 chose) and, on CUDA, the CUDA graphs rank 0 captures, then loops:
receive a plan, run its part of the forward pass (replaying the graph the plan names), take
part in the collectives. Plans arrive through a pipe (``ControlChannel``).

A worker that dies must become a clear error in the engine, never a hang: rank 0 polls
the workers' exit codes before each step, and when a collective fails it names the dead
worker (with the last line of its traceback, which a failing worker leaves in the store).
A worker that hangs makes rank 0's next collective time out (``collective_timeout_s``),
and the error says so.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sid.config import EngineConfig
from sid.engine.plan import PassSizes
from sid.model.config import ModelConfig
from sid.model.decoder import Shard
from sid.model.loader import build_model
from sid.runtime.attention import PagedKVCache, get_backend
from sid.runtime.cuda_graphs import GraphSpec
from sid.runtime.distributed import (
    COLLECTIVE_TIMEOUT,
    GEMMS,
    GRAPHS,
    KV_CACHE,
    STEP,
    STOP,
    ControlChannel,
    ControlReceiver,
    TPGroup,
    init_group,
)
from sid.runtime.gemm import Gemms
from sid.runtime.model_runner import ModelRunner, StepInputs

_HOST = "127.0.0.1"
_KEY = "sid/tp"
_STARTUP_TIMEOUT_S = 600.0
"""Longest a worker may take to join and to load its shard (large checkpoints load slowly)."""
_DEATH_GRACE_S = 3.0
"""After a failed collective, how long rank 0 waits for the worker that broke it to exit."""


class TPGroupError(RuntimeError):
    """The tensor-parallel group broke (a worker died, or a step failed midway): no step can run again."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard and its KV cache."""

    model: str
    load_format: str
    seed: int
    dtype: torch.dtype
    device_type: str
    max_positions: int
    block_size: int
    attention_backend: str
    canonical: PassSizes
    num_threads: int
    """Threads per rank: every rank's CPU GEMMs use the count the fingerprint records."""
    size: int
    collective_timeout: timedelta
    """How long a model collective waits for a peer before it fails (a hung worker)."""
    tp_invariant_chunks: int | None

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")


def worker_main(rank: int, port: int, fd: int) -> None:
    """A worker's life, its plans read from the pipe ``fd``; a failure leaves its traceback
    in the store for rank 0 to report."""
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    try:
        _serve(pickle.loads(store.get(f"{_KEY}/spec")), rank, store, ControlReceiver(fd))
    except BaseException:
        with suppress(Exception):  # the store is gone when rank 0 is
            store.set(f"{_KEY}/error/{rank}", traceback.format_exc())
        raise


def _serve(spec: WorkerSpec, rank: int, store: dist.TCPStore, control: ControlReceiver) -> None:
    torch.set_num_threads(spec.num_threads)
    device = spec.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store.set(f"{_KEY}/joined/{rank}", "1")
    init_group(store, rank, spec.size, device, spec.collective_timeout)
    path = Path(spec.model)
    model = build_model(
        ModelConfig.from_path(path),
        path,
        dtype=spec.dtype,
        device=device,
        max_positions=spec.max_positions,
        load_format=spec.load_format,
        seed=spec.seed,
        tp=TPGroup(rank, spec.size),
    )
    model.gemms.set_fast(device, model.gemm_weights())
    if spec.tp_invariant_chunks is not None:
        model.split_row_parallel(spec.tp_invariant_chunks)
    store.set(f"{_KEY}/ready/{rank}", "1")
    backend = get_backend(spec.attention_backend, device)
    runner: ModelRunner | None = None
    while True:
        kind, arg = control.recv()
        if kind == STOP:
            break
        if kind == GEMMS:
            model.gemms.invariant, model.gemms.padding, model.gemms.sizes = pickle.loads(store.get(f"{_KEY}/gemms"))
        elif kind == KV_CACHE:
            assert isinstance(arg, int)
            runner = None  # free the old cache before allocating the new one
            cache = PagedKVCache.for_model(backend, model, arg, spec.block_size, spec.dtype, device)
            runner = ModelRunner(model, cache, spec.block_size, device, spec.canonical)
        elif kind == GRAPHS:
            assert runner is not None
            graphs: GraphSpec = pickle.loads(store.get(f"{_KEY}/graphs"))
            runner.graphs, runner.pieces = graphs.capture(model, runner.kv_cache)
        else:
            assert kind == STEP and isinstance(arg, StepInputs) and runner is not None
            runner.forward(arg)
    dist.destroy_process_group()


class TPWorkers:
    """Rank 0's handle on the workers: start them, send plans, turn a death into an error, stop them."""

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        canonical: PassSizes,
        max_positions: int,
    ) -> TPWorkers | None:
        """Spawn ranks 1..N-1 of an engine (None at TP=1); the checks that need no model run first."""
        size = config.tensor_parallel_size
        if size == 1:
            return None
        Shard.of(model_config, 0, size)  # a model that cannot be split fails before any spawn
        if device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        spec = WorkerSpec(
            model=str(Path(config.model)),
            load_format=config.load_format,
            seed=config.seed,
            dtype=dtype,
            device_type=device.type,
            max_positions=max_positions,
            block_size=config.block_size,
            attention_backend=config.attention_backend,
            canonical=canonical,
            num_threads=torch.get_num_threads(),
            size=size,
            collective_timeout=timedelta(seconds=config.collective_timeout_s),
            tp_invariant_chunks=config.tp_invariant_chunks,
        )
        return cls(spec, device)

    def __init__(self, spec: WorkerSpec, device: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group: one tensor-parallel engine per "
                "process (shut the other one down first)"
            )
        self.spec = spec
        self.failure: TPGroupError | None = None
        self.plans_sent, self.plan_seconds = 0, 0.0
        self._closed = False
        self.store = dist.TCPStore(_HOST, 0, spec.size, True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        self.store.set(f"{_KEY}/spec", pickle.dumps(spec))
        env = dict(os.environ)  # NCCL settings (NCCL_NVLS_ENABLE=0 on the lent machines) pass through as they are
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.control = ControlChannel([])
        try:
            for r in range(1, spec.size):
                read, write = os.pipe()
                self.control.fds.append(write)
                code = f"from {__name__} import worker_main; worker_main({r}, {self.store.port}, {read})"
                cmd = [sys.executable, "-c", code]
                try:
                    self.procs[r] = subprocess.Popen(cmd, env=env, pass_fds=(read,))
                finally:
                    os.close(read)  # the worker holds it now: its death breaks rank 0's writes
            self._wait_for("joined")
            init_group(self.store, 0, spec.size, device, spec.collective_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.group = TPGroup(0, spec.size)

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def wait_ready(self) -> None:
        """Block until every worker has built its shard (rank 0 builds its own meanwhile)."""
        self._wait_for("ready")

    def set_gemms(self, gemms: Gemms) -> None:
        """Every worker takes rank 0's proven GEMM paths, pad floors and proven row counts
        (its shard has rank 0's shapes)."""
        self._raise_if_dead()
        self.store.set(f"{_KEY}/gemms", pickle.dumps((gemms.invariant, gemms.padding, gemms.sizes)))
        self.control.send(GEMMS)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every worker (re)allocates its KV cache with ``num_blocks`` blocks of its KV heads."""
        self._raise_if_dead()
        self.control.send(KV_CACHE, num_blocks)

    def capture_graphs(self, spec: GraphSpec) -> None:
        """Every worker captures the graphs of ``spec`` over its shard and cache."""
        self._raise_if_dead()
        self.store.set(f"{_KEY}/graphs", pickle.dumps(spec))
        self.control.send(GRAPHS)

    @contextmanager
    def running(self, step: StepInputs) -> Iterator[None]:
        """Send ``step`` to the workers; an error inside (a failed collective, a worker gone
        from the plan pipe) stops the group. A step that failed after waiting out the
        collective timeout is a hung worker, not a dead one."""
        self._raise_if_dead()
        start = time.perf_counter()
        try:
            self.control.send_step(step)
            self.plan_seconds += time.perf_counter() - start
            self.plans_sent += 1
            yield
        except Exception as exc:
            # The ranks are out of step now: whatever failed, no further pass can run.
            timeout = self.spec.collective_timeout.total_seconds()
            if time.perf_counter() - start >= timeout:
                self.failure = TPGroupError(
                    f"a tensor-parallel collective timed out: rank 0 waited {timeout:g} s (collective_timeout_s) for "
                    f"a worker that did not take part, which hangs or is far too slow; the workers were stopped "
                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                )
            else:
                dead = self._wait_for_death(_DEATH_GRACE_S)
                self.failure = self._death(dead) if dead is not None else TPGroupError(
                    f"a tensor-parallel step failed on rank 0 ({exc}); the workers were stopped"
                )
            self.shutdown()
            raise self.failure from exc

    def check_health(self) -> None:
        """Raise ``TPGroupError`` if the group broke or a worker has exited. It only reads
        exit codes (and a dead worker's last words from the store), so a server may call it
        from another thread while the engine steps or idles."""
        if self.failure is not None:
            raise self.failure
        dead = self._first_dead()
        if dead is not None:
            raise self._death(dead)
        if self._closed:
            raise TPGroupError("the tensor-parallel workers were shut down")

    def _wait_for(self, stage: str) -> None:
        keys = [f"{_KEY}/{stage}/{r}" for r in self.procs]
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers were not {stage} after {_STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def _first_dead(self) -> int | None:
        return next((r for r, p in self.procs.items() if p.poll() is not None), None)

    def _raise_if_dead(self) -> None:
        if self.failure is None:
            dead = self._first_dead()
            if dead is None:
                return
            self.failure = self._death(dead)
            self.shutdown()
        raise self.failure

    def _wait_for_death(self, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while (dead := self._first_dead()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return dead

    def _death(self, rank: int) -> TPGroupError:
        message = f"tensor-parallel worker rank {rank} died (exit code {self.procs[rank].poll()})"
        key = f"{_KEY}/error/{rank}"
        with suppress(Exception):
            if self.store.check([key]):
                message += ": " + self.store.get(key).decode().strip().splitlines()[-1]
        return TPGroupError(message)

    def shutdown(self) -> None:
        """Stop the workers (a STOP message, then by force) and leave the process groups; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            with suppress(OSError):  # a worker that is gone already
                self.control.send(STOP)
        self.control.close()
        for proc in self.procs.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0 if self.failure is None else 0.0)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

