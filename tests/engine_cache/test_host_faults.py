"""Fault injection for the Host tier (spec §13.3): a Host allocation that fails at start is a clear startup
error; a forced transfer error in a write-through (at dispatch or in the writer thread) or a restore fails the
engine (every request ends with "error") with no leaked pin, page or slab, and a new engine works after it."""

import functools
import threading
import time

import jax
import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.prefix_cache import HostSlabPool
from ninfer_jax.runtime import startup
from ninfer_jax.runtime.device import host_buffer
from ninfer_jax.runtime.device.host_buffer import HostSlabBuffer, HostTierError, physical_memory_bytes
from ninfer_jax.runtime.request import EngineStoppedError
from cache_support import io_error, tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SMALL = dict(max_concurrency=1, prefill_chunk=128, max_model_len=512, output_window=64, kv_capacity=8 * 64,
             device_snapshot_slots=1, max_new_taps=0, host_cache_mib=4, warmup=False)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41)


def assert_failed_cleanly(engine):
    """The engine failed: requests are refused, and the ledger holds no pin, private page or Filling slab."""
    stats = engine.stats()
    assert stats["failed"] and "HostTransferError" in stats["failed"]
    engine.check_ledger()
    assert stats["pages"]["active"] == 0 and stats["pages"]["filling"] == 0
    assert stats["prefix_cache"]["host_slabs"]["filling"] == 0
    with pytest.raises(EngineStoppedError):
        engine.submit(tokens(10, 0), GREEDY)


def wait_until_failed(engine) -> str:
    """The engine's failure, once its worker has met it (a copy failing off the worker thread fails the engine
    at its next step)."""
    deadline = time.monotonic() + 30
    while not engine.stats()["failed"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.stats()["failed"]


def host_only_resume(engine) -> list[int]:
    """A prompt that resumes from an endpoint whose image is on the Host only: the first conversation's
    endpoint (107, in the one Device snapshot slot) is pushed out of the slot by a second one's."""
    prompt = tokens(100, 4)
    first = engine.generate(prompt, GREEDY)
    engine.generate(tokens(100, 5), GREEDY)
    return prompt + list(first.token_ids)[:7] + tokens(10, 6)


def test_a_host_budget_the_machine_cannot_hold_is_a_startup_error(checkpoint):
    memory = physical_memory_bytes()
    too_much = (memory >> 20) + 1024 if memory else 1 << 40
    with pytest.raises(HostTierError, match="exceeds this machine's memory"):
        Engine.from_pretrained(checkpoint, **{**SMALL, "host_cache_mib": too_much})


def test_a_failed_host_allocation_is_a_startup_error(checkpoint, monkeypatch):
    def refuse(nbytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_buffer, "_allocate_chunk", refuse)
    with pytest.raises(HostTierError, match="cannot allocate Host tier chunk 0"):
        Engine.from_pretrained(checkpoint, **SMALL)


class FakePageLock:
    """cudaHostRegister's stand-in on a CPU: records the threads that lock, fails where told."""

    def __init__(self, fail: bool):
        self.fail, self.threads, self.unlocked = fail, [], 0

    def register(self, address: int, nbytes: int) -> None:
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise HostTierError(f"cudaHostRegister of {nbytes} B failed: injected")

    def unregister(self, address: int) -> None:
        self.unlocked += 1


@pytest.mark.parametrize("fail", [False, True])
def test_page_locking_runs_beside_the_warm_up_and_a_failure_is_a_startup_error(checkpoint, monkeypatch, fail):
    lock = FakePageLock(fail)
    monkeypatch.setattr(host_buffer, "_PageLock", lambda: lock)
    monkeypatch.setattr(startup, "HostSlabBuffer", functools.partial(HostSlabBuffer, pin=True))
    if fail:
        with pytest.raises(HostTierError, match="injected"):
            Engine.from_pretrained(checkpoint, **SMALL)
        assert lock.unlocked == 0
    else:
        with Engine.from_pretrained(checkpoint, **SMALL) as engine:
            assert engine.cache_manager.host.buffer.pinned
            assert engine.generate(tokens(100, 4), GREEDY).finish_reason == "length"
        assert lock.unlocked == 1  # the one chunk, unlocked at stop
    assert lock.threads and all(name.startswith("host-lock") for name in lock.threads)


def test_a_forced_write_through_error_fails_the_engine_cleanly(checkpoint):
    engine = Engine.from_pretrained(checkpoint, **SMALL)
    try:
        assert engine.generate(tokens(100, 1), GREEDY).finish_reason == "length"
        engine.inject_host_fault("write")
        failed = engine.generate_many([tokens(100, 2), tokens(90, 3)], GREEDY)
        # The copies of a finished request start after its answer went out (behind the next model step): a
        # request that finished first keeps its answer; whatever was still running ends with the failure.
        reasons = [o.finish_reason for o in failed]
        assert reasons[-1] == "error" and set(reasons) <= {"error", "length"}
        assert "injected Host write" in failed[-1].error
        assert_failed_cleanly(engine)
        assert engine.stats()["prefix_cache"]["host_writes_failed"] == 1
    finally:
        engine.stop()


def test_a_host_copy_failing_in_the_writer_thread_fails_the_engine_cleanly(checkpoint):
    """Write-through is asynchronous: the copy into the slabs fails off the worker thread; the engine fails at
    its next step, and the write's pins and Filling slabs are released."""
    engine = Engine.from_pretrained(checkpoint, **SMALL)
    try:
        engine.cache_manager.host.buffer.write = io_error
        assert engine.generate(tokens(100, 7), GREEDY).finish_reason == "length"  # its write fails afterwards
        assert "Input/output error" in wait_until_failed(engine)
        assert_failed_cleanly(engine)
        assert engine.stats()["prefix_cache"]["host_writes_failed"] == 1
    finally:
        engine.stop()


def test_a_restore_copy_failing_after_its_dispatch_fails_the_engine_cleanly(checkpoint):
    """Restores are dispatched, not waited for: a copy that fails later fails the engine at its next step, with
    every lane, pin and Filling slab released."""
    engine = Engine.from_pretrained(checkpoint, **SMALL)
    try:
        resume = host_only_resume(engine)
        engine.cache_manager.host._await_copies = io_error
        engine.generate(resume, GREEDY)  # restores the image; its copy "fails" once dispatched
        assert "Host restore failed after its dispatch" in wait_until_failed(engine)
        assert_failed_cleanly(engine)
        assert engine.stats()["prefix_cache"]["host_restores_failed"] == 1
    finally:
        engine.stop()


def test_a_forced_restore_error_fails_the_engine_cleanly_and_a_new_engine_works(checkpoint):
    engine = Engine.from_pretrained(checkpoint, **SMALL)
    try:
        resume = host_only_resume(engine)
        engine.inject_host_fault("restore")
        out = engine.generate(resume, GREEDY)
        assert out.finish_reason == "error" and "injected Host restore" in out.error
        assert_failed_cleanly(engine)
        assert engine.stats()["prefix_cache"]["host_restores_failed"] == 1
    finally:
        engine.stop()
    # A new engine on the same checkpoint serves, restores from its Host tier included.
    fresh = Engine.from_pretrained(checkpoint, **SMALL)
    try:
        again = fresh.generate(host_only_resume(fresh), GREEDY)
        assert again.finish_reason == "length" and again.usage.cached_tokens == 107
        assert fresh.cache_record(again.request_id)["restored_host_bytes"] > 0
        fresh.check_ledger()
    finally:
        fresh.stop()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="page-locking succeeds where there is a GPU")
def test_a_failed_page_lock_is_a_startup_error():
    # Without a usable GPU, cudaHostRegister fails (or no CUDA runtime library is found): a clear error.
    with pytest.raises(HostTierError, match="cudaHostRegister|CUDA runtime"):
        HostSlabBuffer(HostSlabPool(1 << 20, 8000, 20000), pin=True)
