"""Engine: the library API — load a checkpoint, size the device pools, run the worker thread, and hand out
results, streams (sync and async), cancellation, stop and stats.

Every call from user threads only validates and enqueues a command; the worker thread owns all device
state and is its only mutator (spec §10.9). Bad input is refused in the caller's thread before any work,
so the engine keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import random
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.frontend import IncrementalDetokenizer, PreparedPrompt, load_chat_template, load_tokenizer
from ninfer_jax.frontend.prepared_prompt import prepare_tokens
from ninfer_jax.config import ModelConfig
from ninfer_jax.model import load_checkpoint
from ninfer_jax.model.params import Params
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.state import PAGE, page_bytes, prefill_activation_bytes, slot_bytes
from ninfer_jax.model.tiny import default_checkpoint
from ninfer_jax.runtime.device.cache_file import FORMAT, PrefixCacheFile, checkpoint_identity, source_identity
from ninfer_jax.runtime.options import EngineOptions, OptionsError
from ninfer_jax.runtime.prefix.manager import PrefixCacheBinding
from ninfer_jax.runtime.request import (
    EngineStoppedError, InvalidRequestError, Metrics, PromptTooLongError, Request, RequestOutput, StreamEvent,
    Usage,
)
from ninfer_jax.runtime.device.runner import ModelRunner
from ninfer_jax.runtime.sampling import SamplingParams
from ninfer_jax.runtime.scheduler import Worker, pages_for
from pallas_kernels.paged_attention import PrefillConfig

log = logging.getLogger("ninfer_jax.engine")


def _auto_kv_tokens(options: EngineOptions, bytes_per_page: int, fixed_bytes: int, activation_bytes: int) -> int:
    """KV capacity for kv_capacity="auto": the device memory left after weights, state and the longest prefill
    pass's activations, or (on a backend that reports no memory) enough for every lane to reach max_model_len."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return options.max_concurrency * options.max_model_len
    free = limit - stats.get("bytes_in_use", 0) - fixed_bytes
    reserve = max(2 << 30, int(0.05 * limit), activation_bytes)  # activations, compiler scratch
    usable = int((free - reserve) * options.memory_fraction)
    return max(PAGE, usable // bytes_per_page * PAGE)


def is_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (where the cuDNN prefill attention was measured faster)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    return device.platform == "gpu" and capability.split(".")[0] == "9"


class Engine:
    """A Qwen3.5 inference engine over one device. Construct with `Engine.from_pretrained`."""

    def __init__(self, config: ModelConfig, params: Params, options: EngineOptions, *, tokenizer=None,
                 chat_template=None, model_name: str = "model", warmup: bool = True,
                 weights_identity: dict | None = None):
        """Start an engine on loaded params (options.dtype must be the params' dtype).

        weights_identity names the weights (from_pretrained: the checkpoint's files); a prefix_cache_file is
        used only by an engine whose weights, config, dtype, kernels and code equal the saving one's.
        """
        self.config, self.model_name = config, model_name
        self.options = options.resolve(config.max_position_embeddings, jax.default_backend(), moe=config.is_moe,
                                       hopper=is_hopper(jax.devices()[0]))
        o = self.options
        if o.prefix_cache_file is not None and weights_identity is None:
            raise OptionsError("prefix_cache_file needs the weights' identity to know a saved cache is theirs: "
                               "start the engine with Engine.from_pretrained (or pass weights_identity)")
        dtype = o.dtype
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = o.max_model_len
        kv_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        num_slots = o.max_concurrency + o.device_snapshot_slots
        state_bytes = num_slots * slot_bytes(self.config, kv_dtype)
        per_page = max(1, page_bytes(self.config, kv_dtype))
        longest_pass = prefill_activation_bytes(config, o.idle_prefill_chunk, kv_dtype)  # resolved: >= prefill_chunk
        kv_tokens = o.kv_capacity if o.kv_capacity != "auto" else _auto_kv_tokens(o, per_page, state_bytes,
                                                                                  longest_pass)
        num_pages = pages_for(kv_tokens)
        if num_pages < o.max_concurrency:
            raise ValueError(f"kv_capacity {kv_tokens} tokens gives {num_pages} pages, fewer than "
                             f"max_concurrency {o.max_concurrency}")
        self.runner = ModelRunner(
            # With Pallas the GDN decode, each residual add + norm, the MoE router and the attention decode up to
            # its kernel run as one kernel each (decode_round_probe.md), and so does the GDN prefill's conv
            # (prefill_profile.md)
            self.config, params, KernelConfig(o.kernels, o.interpret, PrefillConfig(impl=o.prefill_attention),
                                              fuse_gdn_decode=o.kernels == "pallas",
                                              fuse_add_norm=o.kernels == "pallas",
                                              fuse_moe_route=o.kernels == "pallas",
                                              fuse_attn_qkv=o.kernels == "pallas",
                                              fuse_gdn_conv=o.kernels == "pallas"),
            num_pages=num_pages, num_slots=num_slots,
            max_model_len=o.max_model_len, prefill_chunk=o.prefill_chunk, max_lanes=o.max_concurrency,
            max_taps=o.max_new_taps, kv_dtype=kv_dtype, conv_dtype=kv_dtype, batch_invariant=o.batch_invariant,
            idle_prefill_chunk=o.idle_prefill_chunk,
        )
        log.info("engine options | %s", o.summary())
        log.info(
            "device pools | %d KV pages (%d tokens, %.1f MiB) | %d state slots (%d active + %d snapshot, %.1f MiB)",
            num_pages, num_pages * PAGE, num_pages * per_page / 2**20, num_slots, o.max_concurrency,
            o.device_snapshot_slots, state_bytes / 2**20,
        )
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        # The Host tier is allocated (and page-locked on a GPU) here, before any compile: a budget that cannot
        # be had fails the start with HostTierError (or ValueError below one snapshot plus one block).
        self.cache = PrefixCacheBinding(
            self.runner, num_pages=num_pages, lanes=o.max_concurrency, prefill_chunk=o.prefill_chunk,
            page_bytes=per_page, image_bytes=slot_bytes(self.config, kv_dtype), enabled=not o.no_prefix_reuse,
            policy=o.cache_policy, host_cache_bytes=o.host_cache_mib << 20,
            device_snapshot_slots=o.device_snapshot_slots, max_new_taps=o.max_new_taps,
            tap_ladder_tokens=o.tap_ladder_tokens, tap_min_gap_tokens=o.tap_min_gap_tokens,
            coalesce=o.concurrent_prefill,
        )
        log.info("prefix cache | %s | policy %s | device snapshot slots %d | max new taps %d | ladder %d | gap %d",
                 "on" if self.cache.enabled else "off (no_prefix_reuse)", o.cache_policy,
                 self.cache.options.device_snapshot_slots, self.cache.options.max_new_taps,
                 self.cache.options.tap_ladder_tokens, self.cache.options.tap_min_gap_tokens)
        host = self.cache.host
        if host is not None:
            slabs = self.cache.index.slabs
            log.info("host tier | %.0f MiB | %d slabs of %d KiB in %d chunk(s) | image %d slabs | %s",
                     host.buffer.nbytes / 2**20, slabs.num_slabs, slabs.slab_bytes >> 10, slabs.num_chunks,
                     slabs.image_slabs, "page-locked" if host.buffer.pinned else "pageable (no GPU)")
        elif self.cache.enabled:
            log.info("host tier | off (host_cache_mib 0): Device only")
        self.worker = Worker(self.runner, o, self.cache, frozenset(eos))
        self.cache_file: PrefixCacheFile | None = None
        self.cache_load = None  # the LoadReport of the prefix cache file (§5.5)
        try:  # without warmup, the model steps compile on first use; the small cache copies compile here
            if o.prefix_cache_file is not None and self.cache.host is not None:
                self.cache_file = PrefixCacheFile(o.prefix_cache_file, {
                    "format": FORMAT, "weights": weights_identity, "config": dataclasses.asdict(config),
                    "dtype": o.dtype, "kernels": o.kernels, "prefill_attention": o.prefill_attention,
                    "prefill_chunk": o.prefill_chunk, "idle_prefill_chunk": o.idle_prefill_chunk,
                    "source": source_identity()})
                self.cache_load = self.cache_file.load(self.cache.index, self.cache.host.buffer)
            seconds = self.runner.warmup() if warmup else self.runner.warmup_copies()
        except BaseException:
            self.cache.close()  # the Host tier's memory (and its page-locking) goes with the failed start
            raise
        log.info("compiled | %d programs | %.1f s", self.runner.compile_count(), seconds)
        self.compiles_after_warmup = self.runner.compile_count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._failed: str | None = None
        self._ids = itertools.count()
        self._seed_rng = random.Random(0)
        self._thread = threading.Thread(target=self._run, name="ninfer-worker", daemon=True)
        self._thread.start()
        log.info("engine ready | %s | max_model_len %d | %d lanes", self.model_name, o.max_model_len,
                 o.max_concurrency)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, dtype: str = "auto", max_concurrency: int = 4,
                        prefill_chunk: int | None = None, kv_capacity: int | str = "auto",
                        no_prefix_reuse: bool = False, warmup: bool = True, **other_options) -> "Engine":
        """Load a checkpoint directory (None: the built-in tiny default) and start the engine.

        other_options are EngineOptions fields (max_model_len, kernels, host_cache_mib, ...).
        """
        directory = Path(path) if path is not None else default_checkpoint()
        if dtype == "auto":
            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        try:
            options = EngineOptions(dtype=dtype, max_concurrency=max_concurrency, prefill_chunk=prefill_chunk,
                                    kv_capacity=kv_capacity, no_prefix_reuse=no_prefix_reuse, **other_options)
        except TypeError as e:
            raise ValueError(f"unknown engine option: {e}") from None
        options.resolve(10**9, jax.default_backend())  # refuse bad options before reading any weights
        config, params = load_checkpoint(directory, dtype=dtype)
        return cls(config, params, options, tokenizer=load_tokenizer(directory),
                   chat_template=load_chat_template(directory), model_name=directory.name, warmup=warmup,
                   weights_identity=checkpoint_identity(directory))

    # --- worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        worker = self.worker
        try:
            while True:
                self._drain()
                if self._stopping:
                    worker.abort_all("unavailable")
                    return
                if not worker.step():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except Exception as e:  # a device or logic error (a Host transfer too): the engine cannot continue
            log.exception("engine failed | %s", e)
            self._failed = f"{type(e).__name__}: {e}"
            self.cache.fail()  # no copy runs any more; pending writes complete as failed
            worker.abort_all("error", self._failed)

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":  # a list: generate_many's requests arrive together
                for req in arg:
                    self.worker.add(req)
            elif kind == "cancel":
                self.worker.cancel(arg)
            elif kind == "call":  # a function run on the worker thread (stats, ledger checks)
                fn, box = arg
                try:
                    box.put((True, fn()))
                except Exception as e:
                    box.put((False, e))

    def _send(self, kind: str, arg) -> None:
        self._commands.put((kind, arg))
        self._wake.set()

    def _call(self, fn, timeout: float = 60.0):
        """Runs fn() on the worker thread and returns its result."""
        if not self._thread.is_alive():
            return fn()
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._send("call", (fn, box))
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, value = box.get(timeout=0.05)
                break
            except queue.Empty:
                if not self._thread.is_alive():  # it ended (stop, failure) before answering: nothing mutates now
                    try:
                        ok, value = box.get_nowait()
                        break
                    except queue.Empty:
                        return fn()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine's worker did not answer within {timeout:.0f} s")
        if not ok:
            raise value
        return value

    # --- requests --------------------------------------------------------------------------------
    def _prepare(self, prompt) -> PreparedPrompt:
        if isinstance(prompt, PreparedPrompt):
            prepared = prompt
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer files; send token ids")
            prepared = prepare_tokens(self.tokenizer.encode(prompt))
        else:
            try:
                ids = np.asarray(prompt)
            except Exception:
                raise InvalidRequestError("prompt must be text, a list of token ids or a PreparedPrompt") from None
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise InvalidRequestError("prompt token ids must be a flat list of integers")
            if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.config.vocab_size})")
            prepared = prepare_tokens(ids)
        ids = prepared.token_ids
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if n + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len}, leaving no room for output"
            )
        if pages_for(n + 1) > self.worker.pages.capacity:
            raise PromptTooLongError(
                f"prompt has {n} tokens; the KV pool holds {self.worker.pages.capacity * PAGE} tokens"
            )
        return prepared

    def submit(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
               sink=None) -> str:
        """Queue a request (non-blocking) and return its id. Events go to `sink` (a callable)."""
        req = self._request(prompt, sampling, request_id, sink)
        self._send("add", [req])
        return req.id

    def _request(self, prompt, sampling: SamplingParams | None, request_id: str | None, sink) -> Request:
        if self._stopping or self._failed:
            raise EngineStoppedError(self._failed or "engine is stopped")
        sampling = sampling or SamplingParams()
        prepared = self._prepare(prompt)
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True) if self.tokenizer else None
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(32)
        return Request(rid, prepared, sampling, seed, sink or (lambda ev: None), detok)

    def stream(self, prompt, sampling: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamEvent]:
        """Events of one request as they happen (blocking iterator); the last has finish_reason set."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(prompt, sampling, request_id, sink=events.put)
        while True:
            event = events.get()
            yield event
            if event.finish_reason is not None:
                return

    async def astream(self, prompt, sampling: SamplingParams | None = None,
                      request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """The async form of `stream`, for event loops (the server)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self.submit(prompt, sampling, request_id, sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        while True:
            event = await events.get()
            yield event
            if event.finish_reason is not None:
                return

    def generate(self, prompt, sampling: SamplingParams | None = None) -> RequestOutput:
        return self.generate_many([prompt], sampling)[0]

    def generate_many(self, prompts: Sequence, sampling: SamplingParams | Sequence[SamplingParams] | None = None
                      ) -> list[RequestOutput]:
        """Submit every prompt at once (they run concurrently) and wait for all of them. They reach the worker
        in one command, so they are admitted in one step, in order."""
        if not isinstance(sampling, (list, tuple)):
            sampling = [sampling] * len(prompts)
        prepared = [self._prepare(p) for p in prompts]  # refuse the whole batch before queueing any
        boxes = [(p, sp, queue.SimpleQueue()) for p, sp in zip(prepared, sampling)]
        reqs = [self._request(p, sp, None, events.put) for p, sp, events in boxes]
        self._send("add", reqs)
        return [self._collect(req.id, p, events) for req, (p, _, events) in zip(reqs, boxes)]

    @staticmethod
    def _collect(rid, prepared, events) -> RequestOutput:
        tokens, text, logprobs = [], [], []
        while True:
            ev: StreamEvent = events.get()
            tokens += ev.token_ids
            text.append(ev.text)
            logprobs += ev.logprobs or ()
            if ev.finish_reason is not None:
                return RequestOutput(
                    rid, tuple(int(t) for t in prepared.token_ids), tuple(tokens), "".join(text), ev.finish_reason,
                    ev.usage, ev.metrics, tuple(logprobs) or None, ev.error,
                )

    def cancel(self, request_id: str) -> bool:
        """Cancel at the next unit boundary; its stream ends with finish_reason "cancelled"."""
        if not self._thread.is_alive():
            return False
        self._send("cancel", request_id)
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Orderly stop: queued and running requests end with finish_reason "unavailable"."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._save_cache()
            self.cache.close()  # the Host tier's memory (unregistered on a GPU)
        log.info("engine stopped | %s", self.model_name)

    def _save_cache(self) -> None:
        """§5.5: after the worker released every lane (their blocks were written through), every Host write
        lands and the Host tier goes to prefix_cache_file. An engine that failed saves nothing, so the previous
        file stays; a save that fails is logged and leaves the previous file too."""
        cache_file, self.cache_file = self.cache_file, None  # a second stop() saves nothing
        if cache_file is None:
            return
        if self._failed is not None:
            log.warning("prefix cache not saved | the engine failed (%s); %s keeps its previous content",
                        self._failed, cache_file.path)
            return
        self.cache.poll_writes(wait=True)  # the worker has ended: this thread is the cache's only user now
        if self.cache.failed:
            log.warning("prefix cache not saved | a Host copy failed; %s keeps its previous content", cache_file.path)
            return
        try:
            cache_file.save(self.cache.index, self.cache.host.buffer)
        except OSError as e:
            log.error("prefix cache not saved | %s: %s", cache_file.path, e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # --- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        worker = self._call(self.worker.stats)
        c = worker["counters"]
        return {
            "requests": {"waiting": worker["waiting"], "running": worker["running"],
                         **{k: v for k, v in c.items() if k.startswith(("requests_", "finished_"))}},
            "tokens": {"prompt": c.get("prefill_tokens", 0), "generated": c.get("generated_tokens", 0)},
            "pages": worker["pages"],
            "slots": {"active": self.options.max_concurrency, "snapshot": self.options.device_snapshot_slots},
            "scheduler": {k: v for k, v in c.items() if not k.startswith(("requests_", "finished_"))},
            "prefix_cache": {**self._call(self.cache.stats),
                             **({"loaded": dataclasses.asdict(self.cache_load)} if self.cache_load else {})},
            "compiles_since_warmup": self.runner.compile_count() - self.compiles_after_warmup,
            "failed": self._failed,
        }

    def check_ledger(self) -> None:
        """Raises AssertionError if any page, slot or Host slab is owned by nobody, or a pin leaked (run on
        the worker thread)."""
        self._call(self.worker.check_ledger)

    def cache_record(self, request_id: str) -> dict | None:
        """The prefix-cache record of a recently finished request: cached_tokens, cached_prefix_tokens,
        source (root / tap / endpoint / boundary) and restored_host_bytes; None when unknown."""
        return self._call(lambda: self.cache.record(request_id))

    def demote_device_cache(self) -> dict:
        """Drops the Device copy of every prefix-cache entry that also has a Host copy (blocks, tails, snapshot
        images), so later hits restore from the Host; returns {"pages": freed, "slots": freed}. Entries held by
        a running request, or with no Host copy, stay."""
        return self._call(self.cache.demote_device)

    def inject_host_fault(self, kind: str, times: int = 1) -> None:
        """Fault injection (tests): the next `times` Host transfers of `kind` ("write" or "restore") raise.
        A failed transfer fails the engine: every request ends with finish_reason "error"."""
        if self.cache.host is None:
            raise ValueError("this engine has no Host tier")
        self._call(lambda: self.cache.host.inject_fault(kind, times))


__all__ = ["Engine", "EngineStoppedError", "InvalidRequestError", "Metrics", "PromptTooLongError",
           "RequestOutput", "StreamEvent", "Usage"]
