"""Compiling a fixed sequence of step calls on a thread pool before running them (the runner's warm-up).

The sequence is played twice. First every jitted step is replaced by `AheadOfTime.lowering`'s stand-in: it lowers
the call with the arguments it is given (tracing holds the GIL, so lowering stays on the calling thread), hands the
compile to the pool (XLA releases the GIL while it compiles) and returns the outputs' shapes, which the calls after
it lower with. Then the sequence runs for real through `AheadOfTime.waiting`'s stand-ins, each call waiting for its
own compile only: the first programs run while later ones still compile. jax keeps the executable that
`Lowered.compile()` builds with the lowering, which the jitted function's own call finds (a call with the same
argument shapes, shardings and static values lowers to the same cached computation), so the real calls compile
nothing. Two calls of one program (a step's logprobs for the greedy and the full sampler) compile once.

A compile that fails while others run beside it is tried once more alone, after them: with several compiles at once
XLA's GEMM autotuner has failed every config of a fusion on its redzone checks (the 27B on FP8 weights at 128 lanes,
`docs/benchmarks/wide_decode.md`), while the same programs compiled one at a time did not.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Self

import jax

log = logging.getLogger("ninfer_jax.runner")


class _Shape(jax.ShapeDtypeStruct):
    """An output of a lowered call: its shape for the calls that read it; the copy to the host the dispatch code
    starts on a real output has nothing to copy."""

    __slots__ = ()

    def copy_to_host_async(self) -> None:
        pass


class AheadOfTime:
    """Records a sequence of jitted calls, compiles each distinct program once on `threads` threads, then replays
    the calls in the same order, each after its compile. Use as a context manager (it owns the pool)."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"compile_threads must be a positive integer, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="compile")
        self._calls: list[tuple[str, object]] = []  # (step name, its program's key in _compiles) per recorded call
        self._compiles: dict = {}  # lowering -> (Lowered, Future): one compile per distinct program
        self._retried: set = set()  # programs compiled a second time, alone
        self._replayed = 0
        self.lowering_by_step: dict[str, float] = {}  # seconds lowering each step's calls

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        # A failed warm-up leaves no compile running behind it.
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def programs(self) -> int:
        """The distinct programs recorded so far."""
        return len(self._compiles)

    def lowering(self, name: str, fn):
        """A stand-in for the jitted `fn` that lowers its call, starts its compile and returns its outputs' shapes."""

        def call(*args, **kwargs):
            start = time.perf_counter()
            lowered = fn.lower(*args, **kwargs)
            # Lowering the same program again returns jax's cached computation: key on it, so it compiles once.
            key = lowered._lowering
            if key not in self._compiles:
                self._compiles[key] = (lowered, self._pool.submit(lowered.compile))
            self._calls.append((name, key))
            self.lowering_by_step[name] = self.lowering_by_step.get(name, 0.0) + time.perf_counter() - start
            return jax.tree.map(lambda s: _Shape(s.shape, s.dtype, weak_type=s.weak_type), lowered.out_info)

        return call

    def waiting(self, name: str, fn):
        """A stand-in for the jitted `fn` that waits for the compile of the next recorded call, then calls fn."""

        def call(*args, **kwargs):
            if self._replayed >= len(self._calls) or self._calls[self._replayed][0] != name:
                raise RuntimeError(f"the replayed warm-up called {name} where the recorded one called "
                                   f"{self._calls[self._replayed][0] if self._replayed < len(self._calls) else 'none'}")
            self._compiled(self._calls[self._replayed][1])  # a failed compile raises here, on the caller's thread
            self._replayed += 1
            return fn(*args, **kwargs)

        return call

    @property
    def lowering_s(self) -> float:
        """Seconds spent lowering so far."""
        return sum(self.lowering_by_step.values())

    def slowest(self, count: int = 4) -> str:
        """The steps that took longest to lower, with their seconds (for the log)."""
        ranked = sorted(self.lowering_by_step.items(), key=lambda kv: -kv[1])[:count]
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in ranked)

    @property
    def recorded(self) -> int:
        """The calls recorded so far."""
        return len(self._calls)

    def wait_compiled(self, calls: int) -> None:
        """Waits for the compiles of the first `calls` recorded calls: compiling without replaying
        (`ModelRunner.compile_rest`). A failed compile raises here."""
        for _, key in self._calls[:calls]:
            self._compiled(key)

    def _compiled(self, key) -> None:
        """Waits for program `key`'s compile. If it failed with other compiles beside it, compiles it again on this
        thread once every other compile has ended; a failure then (or on a pool of one thread) raises."""
        lowered, future = self._compiles[key]
        try:
            future.result()
            return
        except jax.errors.JaxRuntimeError as failure:
            if self.threads == 1 or key in self._retried:
                raise
            reason = str(failure).strip().splitlines()[0][:200]
        self._retried.add(key)
        wait([f for _, f in self._compiles.values() if f is not future])
        log.warning("compiling | a compile failed beside others (%s) | compiling it again alone", reason)
        start = time.perf_counter()
        lowered.compile()
        done: Future = Future()
        done.set_result(None)
        self._compiles[key] = (lowered, done)
        log.info("compiling | compiled again alone in %.1f s", time.perf_counter() - start)

    def check_replayed(self) -> None:
        """Raises unless the replay made every recorded call."""
        if self._replayed != len(self._calls):
            raise RuntimeError(f"the replayed warm-up made {self._replayed} of the {len(self._calls)} recorded calls")


__all__ = ["AheadOfTime"]
