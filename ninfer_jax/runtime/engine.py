"""Engine: the library API: requests in, results, streams (sync and async), cancellation, stop and stats out.

Every call from user threads only validates and enqueues a command; the engine's thread runs the Scheduler, which
owns all device state and is its only mutator (spec §10.9). Bad input is refused in the caller's thread before any
work, so the engine keeps serving everyone else. `startup.build` makes the parts from the options.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import itertools
import logging
import queue
import random
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Sequence

import jax

from ninfer_jax.config import ModelConfig
from ninfer_jax.frontend import (ChatTemplate, IncrementalDetokenizer, PreparedPrompt, VisionFrontend,
                                 load_chat_template, load_tokenizer, prepare_chat)
from ninfer_jax.hub import resolve_checkpoint
from ninfer_jax.model import load_checkpoint
from ninfer_jax.model.loader import has_vision_tower, load_dummy, load_vision_checkpoint
from ninfer_jax.model.params import Params
from ninfer_jax.model.state import PAGE
from ninfer_jax.model.tiny import default_checkpoint, qwen35_tokenizer_dir
from ninfer_jax.runtime import startup
from ninfer_jax.runtime.bad_words import BadWords, token_sequences
from ninfer_jax.runtime.device.cache_file import checkpoint_identity
from ninfer_jax.runtime.options import EngineOptions
from ninfer_jax.runtime.request import (
    EngineStoppedError, InvalidRequestError, Metrics, PromptTooLongError, Request, RequestOutput, StreamEvent, Usage,
    prepare_prompt,
)
from ninfer_jax.runtime.sampling import SamplingParams, generation_defaults, pack_token_bits
from ninfer_jax.runtime.scheduler import Scheduler
from ninfer_jax.runtime.structured import GrammarCompiler
from ninfer_jax.runtime.thinking_budget import THINK_CLOSE, ThinkingBudget, think_close_id

log = logging.getLogger("ninfer_jax.engine")

# The third gc threshold (young collections between full ones; Python's default is 10) while the background compiles.
DEFERRED_FULL_COLLECTIONS = 1000


# Commands from user threads to the engine's thread, applied between scheduler steps.
@dataclasses.dataclass(frozen=True)
class _Add:
    requests: list[Request]  # generate_many's requests arrive together, so one step admits them in order

    def apply(self, scheduler: Scheduler) -> None:
        for req in self.requests:
            scheduler.add(req)


@dataclasses.dataclass(frozen=True)
class _Cancel:
    request_id: str

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.cancel(self.request_id)


@dataclasses.dataclass(frozen=True)
class _Call:
    fn: Callable[[], object]  # run on the engine's thread (stats, ledger checks)
    box: queue.SimpleQueue

    def apply(self, scheduler: Scheduler) -> None:
        try:
            self.box.put((True, self.fn()))
        except Exception as e:
            self.box.put((False, e))


class Engine:
    """A Qwen3.5 inference engine over one device. Construct with `Engine.from_pretrained`."""

    STATS_PERIOD_S = 0.25  # how often the engine's thread publishes its stats (`published_stats`)

    def __init__(self, config: ModelConfig, params: Params, options: EngineOptions, *, tokenizer=None,
                 chat_template=None, model_name: str = "model", warmup: bool = True,
                 weights_identity: dict | None = None, progress=None, vision=None, sampling_defaults=None):
        """Start an engine on loaded params (options.dtype must be the params' dtype).

        sampling_defaults: SamplingParams fields for requests submitted without SamplingParams (from_pretrained:
        the checkpoint's generation_config.json, `generation_defaults`); the server fills a request's unset
        fields from them too.

        vision: None, or (VisionConfig, VisionParams, VisionFrontend): the vision tower and the frontend's image
        expansion (`self.vision`, which `prepare_chat(..., vision=engine.vision)` takes).

        weights_identity names the weights (from_pretrained: the checkpoint's files); a prefix_cache_file is
        used only by an engine whose weights, config, dtype, kernels and code equal the saving one's.
        progress(stage, done, total) hears of the startup's steps ("compiling", "restoring").
        """
        self.config, self.model_name = config, model_name
        share = startup.device_share(config, params, options)  # what one device of the mesh holds
        self.options = o = startup.resolve_options(options, config, share)
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_model_len = o.max_model_len
        eos = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.vision = None
        if vision is not None:  # images resized to at most max_image_tokens, the encoder's largest program
            vcfg, vparams, frontend = vision
            self.vision = frontend.limited_to(o.max_image_tokens)
        parts = startup.build(config, params, o, stop_ids=frozenset(eos), warmup=warmup,
                              weights_identity=weights_identity, progress=progress,
                              vision=None if vision is None else (*vision[:2], self.vision.patch_range()),
                              share=share)
        self.runner, self.cache_manager, self.scheduler = parts.runner, parts.cache_manager, parts.scheduler
        self.cache_load = parts.cache_load  # the LoadReport of the prefix cache file (§5.5)
        self._cache_file = parts.cache_file
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._abandon_save = threading.Event()  # `abandon_save`: the prefix cache file's save stops (§5.5)
        self._failed: str | None = None
        self._ids = itertools.count()
        self._seed_rng = random.Random(o.seed)  # the seeds of requests that give none (--seed)
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size, eos)  # response_format, in callers' threads
        self._published, self._published_at = self._collect_stats(detail=False), time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()
        # The compiles counted on its ident before it started (a dead thread's ident is reused).
        self._compiles_before = self.runner.compiles_on(self._thread.ident)
        self._compiler = None  # the thread of `ModelRunner.compile_rest` (background_compile)
        if warmup and self.runner.compiling:
            self._compiler = threading.Thread(target=self._compile_rest, name="ninfer-compile", daemon=True)
            self._compiler.start()
        log.info("engine ready | %s | max_model_len %d | %d lanes", model_name, o.max_model_len, o.max_concurrency)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, dtype: str = "auto", max_concurrency: int | str = "auto",
                        prefill_chunk: int | None = None, kv_capacity: int | str = "auto",
                        no_prefix_reuse: bool = False, warmup: bool = True, progress=None,
                        **other_options) -> "Engine":
        """Load a checkpoint (a folder, a Hugging Face repo id in the local cache or downloaded into it, `hub.py`;
        None: the built-in tiny default) and start the engine. With load_format="dummy" the weights are random at
        the shapes of its config.json (or of `path`, a config .json file), with its tokenizer files or else the
        Qwen3.5 tokenizer.

        other_options are EngineOptions fields (max_model_len, kernels, host_cache_mib, ...); progress(stage, done,
        total) hears of the startup's steps: "loading" (layers), "compiling" (programs), "restoring" (the prefix
        cache file), then ("ready", 1, 1).
        """
        if dtype == "auto":
            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        try:
            options = EngineOptions(dtype=dtype, max_concurrency=max_concurrency, prefill_chunk=prefill_chunk,
                                    kv_capacity=kv_capacity, no_prefix_reuse=no_prefix_reuse, **other_options)
        except TypeError as e:
            raise ValueError(f"unknown engine option: {e}") from None
        # refuse bad options before reading any weights
        resolved = options.resolve(10**9, jax.default_backend(), devices=jax.device_count())
        template = None if options.chat_template is None else ChatTemplate.from_option(options.chat_template)
        directory, name = (default_checkpoint(), default_checkpoint().name) if path is None \
            else resolve_checkpoint(path)
        if options.load_format == "dummy":
            config_file = directory if directory.is_file() else directory / "config.json"
            config, params, tower = load_dummy(config_file, dtype, init=startup.parallel_init(options))
            directory = config_file.parent
            tokenizer = load_tokenizer(directory) or load_tokenizer(qwen35_tokenizer_dir())
            # Seed 0 weights are a function of the config: a saved prefix cache serves the next dummy load
            identity = {"load_format": "dummy", "config": hashlib.sha256(config_file.read_bytes()).hexdigest()}
        else:
            # A tensor-parallel engine places each shard on its own device from host memory
            config, params = load_checkpoint(directory, dtype=dtype, progress=progress,
                                             host=options.tensor_parallel_size > 1)
            tokenizer = load_tokenizer(directory)
            config_file = directory / "config.json"
            tower = load_vision_checkpoint(directory, dtype=dtype) if has_vision_tower(config_file) else None
            identity = checkpoint_identity(directory)
        defaults = _sampling_defaults(options.generation_config, directory)
        frontend = VisionFrontend.from_checkpoint(directory, tokenizer, config_file=config_file) if tower else None
        vision = (*tower, frontend) if frontend is not None else None  # a VLM whose image placeholder is known
        template = template or load_chat_template(directory)
        params = startup.kernel_params(params, resolved, config)
        engine = cls(config, params, options, tokenizer=tokenizer, chat_template=template,
                     model_name=name, warmup=warmup, weights_identity=identity, progress=progress, vision=vision,
                     sampling_defaults=defaults)
        if progress is not None:
            progress("ready", 1, 1)
        return engine

    # --- the engine's thread --------------------------------------------------------------------
    def _compile_rest(self) -> None:
        """The programs the warm-up left to the background (`ModelRunner.compile_rest`), while the engine serves.

        Python's full collections are deferred meanwhile: each scans every object the lowering keeps (jax's caches
        of each program), and on a CPU probe of the 35B-A3B's 40 layers they held the GIL up to 1.6 s at a time,
        stalling the server's event loop (/metrics p99 about 3 s on the H200). One collection at the end, then the
        survivors are frozen out of later full collections."""
        thresholds = gc.get_threshold()
        gc.set_threshold(thresholds[0], thresholds[1], DEFERRED_FULL_COLLECTIONS)
        try:
            seconds = self.runner.compile_rest(self.options.compile_threads, stopping=lambda: self._stopping)
        except Exception:
            log.exception("compiling in the background failed; the steps keep the sizes compiled at startup")
            return
        finally:
            gc.set_threshold(*thresholds)
            started = time.perf_counter()
            gc.collect()
            gc.freeze()
            log.info("background compile ended | collected and froze %d objects in %.2f s", gc.get_freeze_count(),
                     time.perf_counter() - started)
        if not self.runner.compiling:
            log.info("compiled in the background | every size ready | %.1f s", seconds)

    def _engine_compiles(self) -> int:
        """Step compiles on the engine's thread since it started: the compiles a request waited on."""
        thread = getattr(self, "_thread", None)  # None while __init__ publishes the first stats
        return 0 if thread is None else self.runner.compiles_on(thread.ident) - self._compiles_before

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for the background compile (background_compile); returns whether every size is ready."""
        if self._compiler is not None:
            self._compiler.join(timeout)
        return not self.runner.compiling

    def _run(self) -> None:
        scheduler = self.scheduler
        try:
            while True:
                self._drain()
                if self._stopping:
                    scheduler.abort_all("unavailable")
                    return
                if not scheduler.step():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                if time.monotonic() - self._published_at >= self.STATS_PERIOD_S:
                    self._published, self._published_at = self._collect_stats(detail=False), time.monotonic()
        except Exception as e:  # a device or logic error (a Host transfer too): the engine cannot continue
            log.exception("engine failed | %s", e)
            self._failed = f"{type(e).__name__}: {e}"
            self.cache_manager.fail()  # no copy runs any more; pending writes complete as failed
            scheduler.abort_all("error", self._failed)

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command.apply(self.scheduler)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _call(self, fn, timeout: float = 60.0):
        """Runs fn() on the engine's thread and returns its result."""
        if not self._thread.is_alive():
            return fn()
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._send(_Call(fn, box))
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
                    raise TimeoutError(f"the engine's thread did not answer within {timeout:.0f} s")
        if not ok:
            raise value
        return value

    # --- requests --------------------------------------------------------------------------------
    def _sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        """`sampling`, or the engine's defaults (the checkpoint's generation_config) for a request without one."""
        return sampling if sampling is not None else SamplingParams(**self.sampling_defaults)

    def _prepare(self, prompt, sampling: SamplingParams) -> PreparedPrompt:
        """The checked prompt, cut to `sampling`'s truncate_prompt_tokens when it has one."""
        prepared = prepare_prompt(prompt, self.tokenizer, self.config.vocab_size, self.max_model_len,
                                  self.scheduler.pages.capacity * PAGE, sampling.truncate_prompt_tokens)
        if prepared.media is not None:
            if self.vision is None:
                raise InvalidRequestError("the prompt has images and this model has no vision tower")
            largest = self.runner.patch_buckets[-1]
            for i, image in enumerate(prepared.media.images):
                if len(image.patches) > largest:
                    raise InvalidRequestError(f"image {i} has {len(image.patches)} patches; at most {largest} "
                                              f"(max_image_tokens {self.options.max_image_tokens}): prepare the "
                                              f"prompt with engine.vision")
        return prepared

    def submit(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
               sink=None) -> str:
        """Queue a request (non-blocking) and return its id. Events go to `sink` (a callable)."""
        sampling = self._sampling(sampling)
        req = self._request(self._prepare(prompt, sampling), sampling, request_id, sink)
        self._send(_Add([req]))
        return req.id

    def submit_samples(self, prompt, samplings: Sequence[SamplingParams], sinks: Sequence) -> list[str]:
        """n samples of one prompt (OpenAI's `n`), queued together as one group: the first prefills the prompt and
        the others resume from its snapshot at their divergence (spec §12.2), so the prompt is computed once.
        Returns their ids; sample i's events go to sinks[i]. Give the samplings different seeds (or none)."""
        samplings = [self._sampling(sp) for sp in samplings]
        prepared = self._prepare(prompt, samplings[0] if samplings else self._sampling(None))
        return [req.id for req in self._submit_group(prepared, samplings, sinks)]

    def _submit_group(self, prepared: PreparedPrompt, samplings: Sequence[SamplingParams], sinks) -> list[Request]:
        group = f"group-{uuid.uuid4().hex[:8]}"
        barred: dict = {}  # the samples' bad_words, tokenized once (BadWords is read-only: they share it)
        reqs = [self._request(prepared, sp, None, sink, barred) for sp, sink in zip(samplings, sinks, strict=True)]
        for req in reqs:
            req.group = group
        self._send(_Add(reqs))
        return reqs

    def _request(self, prepared: PreparedPrompt, sampling: SamplingParams, request_id: str | None, sink,
                 barred: dict | None = None) -> Request:
        """A request of a prompt `_prepare` has checked and cut (under this sampling's truncate_prompt_tokens).
        `barred`: bad_words already tokenized for requests queued with this one."""
        if self._stopping or self._failed:
            raise EngineStoppedError(self._failed or "engine is stopped")
        grammar = self._checked(sampling)
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=sampling.skip_special_tokens) \
            if self.tokenizer else None
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(32)
        allowed = None if sampling.allowed_token_ids is None else \
            pack_token_bits(sampling.allowed_token_ids, self.config.vocab_size)
        return Request(rid, prepared, sampling, seed, sink or (lambda ev: None), detok, grammar=grammar,
                       allowed=allowed, bad_words=self._bad_words(sampling.bad_words, barred),
                       thinking=self._thinking(sampling.thinking_budget))

    def _thinking(self, budget: int | None) -> ThinkingBudget | None:
        if budget is None:
            return None
        end = think_close_id(self.tokenizer)
        if end is None:
            raise InvalidRequestError(f"thinking_budget needs a tokenizer with {THINK_CLOSE} as one token")
        return ThinkingBudget(budget, end)

    def _bad_words(self, words: tuple[str, ...] | None, barred: dict | None) -> BadWords | None:
        if words is None:
            return None
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs the checkpoint's tokenizer files")
        barred = {} if barred is None else barred
        if words not in barred:
            barred[words] = BadWords(token_sequences(words, self.tokenizer), self.config.vocab_size)
        return barred[words]

    def prepare_sampling(self, sampling: SamplingParams) -> None:
        """Checks `sampling` against the model and compiles its response_format ahead of `submit`, which then
        finds the grammar compiled (blocking: an event loop calls it from a worker thread). Raises
        InvalidRequestError."""
        self._checked(sampling)

    def _checked(self, sampling: SamplingParams):
        """`sampling`'s grammar (None without a response_format), once it is checked against this engine."""
        if sampling.prompt_logprobs is not None and not self.options.prompt_logprobs:
            raise InvalidRequestError("prompt_logprobs: this engine was started without them (--no-prompt-logprobs)")
        if sampling.priority != 0 and self.options.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority {sampling.priority}: this engine schedules requests in arrival "
                                      f"order; start it with scheduling_policy 'priority' (--scheduling-policy "
                                      f"priority)")
        return self.grammars.prepare(sampling)

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

    def generate_samples(self, prompt, sampling: SamplingParams | None = None, *, n: int) -> list[RequestOutput]:
        """n samples of one prompt (vLLM's `n`, the server's): the prompt is computed once (`submit_samples`), and
        a seed s gives sample i the seed s + i (`SamplingParams.samples`). Blocks until all are done."""
        samplings = self._sampling(sampling).samples(n)
        prepared = self._prepare(prompt, samplings[0])
        boxes = [queue.SimpleQueue() for _ in samplings]
        reqs = self._submit_group(prepared, samplings, [box.put for box in boxes])
        return [self._collect(req.id, prepared, box) for req, box in zip(reqs, boxes)]

    def chat(self, messages: Sequence[dict], sampling: SamplingParams | None = None, *, tools=None,
             enable_thinking: bool = True, cache_salt: str | None = None, **template_kwargs) -> RequestOutput:
        """A conversation (OpenAI-format messages, image parts as `prepare_chat` takes them) rendered with the
        checkpoint's chat template and generated, as vLLM's LLM.chat; the text is the raw model output (thinking
        and tool-call markup included)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer files; chat needs one")
        prompt = prepare_chat(self.tokenizer, messages, tools, enable_thinking=enable_thinking,
                              template=self.chat_template, vision=self.vision, cache_salt=cache_salt,
                              **template_kwargs)
        return self.generate(prompt, sampling)

    def generate_many(self, prompts: Sequence, sampling: SamplingParams | Sequence[SamplingParams] | None = None
                      ) -> list[RequestOutput]:
        """Submit every prompt at once (they run concurrently) and wait for all of them. They reach the scheduler
        in one command, so they are admitted in one step, in order."""
        if not isinstance(sampling, (list, tuple)):
            sampling = [sampling] * len(prompts)
        sampling = [self._sampling(sp) for sp in sampling]
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, sampling)]  # refuse the batch before queueing any
        boxes = [(p, sp, queue.SimpleQueue()) for p, sp in zip(prepared, sampling)]
        reqs = [self._request(p, sp, None, events.put) for p, sp, events in boxes]
        self._send(_Add(reqs))
        return [self._collect(req.id, p, events) for req, (p, _, events) in zip(reqs, boxes)]

    @staticmethod
    def _collect(rid, prepared, events) -> RequestOutput:
        tokens, text, logprobs, prompt_logprobs = [], [], [], None
        while True:
            ev: StreamEvent = events.get()
            tokens += ev.token_ids
            text.append(ev.text)
            logprobs += ev.logprobs or ()
            prompt_logprobs = ev.prompt_logprobs or prompt_logprobs
            if ev.finish_reason is not None:
                return RequestOutput(
                    rid, tuple(int(t) for t in prepared.token_ids), tuple(tokens), "".join(text), ev.finish_reason,
                    ev.usage, ev.metrics, tuple(logprobs) or None, ev.error, prompt_logprobs,
                )

    def cancel(self, request_id: str) -> bool:
        """Cancel at the next unit boundary; its stream ends with finish_reason "cancelled"."""
        if not self._thread.is_alive():
            return False
        self._send(_Cancel(request_id))
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Orderly stop: queued and running requests end with finish_reason "unavailable"."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._compiler is not None:
            self._compiler.join(timeout)  # it stops at its next program
        if not self._thread.is_alive():
            self._save_cache()
            self.cache_manager.close()  # the Host tier's memory (unregistered on a GPU)
        log.info("engine stopped | %s", self.model_name)

    def _save_cache(self) -> None:
        """§5.5: once the scheduler released every lane (their blocks were written through), the Host tier goes to
        prefix_cache_file. An engine that failed saves nothing, and a save that fails is logged: either way the
        previous file stays."""
        cache_file, self._cache_file = self._cache_file, None  # a second stop() saves nothing
        if cache_file is None:
            return
        why = f"the engine failed ({self._failed})" if self._failed is not None else \
            self.cache_manager.save(cache_file, self._abandon_save)
        if why is not None:
            log.warning("prefix cache not saved | %s; %s keeps its previous content", why, cache_file.path)

    def abandon_save(self) -> None:
        """Stops the prefix cache file's save (`stop()` runs it) before its next entry or its rename, from any
        thread; a save not begun yet never begins. The previous file stays in place (§5.5: ninfer-serve calls this
        on a second Ctrl+C)."""
        self._abandon_save.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # --- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Requests, tokens, pages, slots, the scheduler's counters and the prefix cache's, exact as of now (the
        engine's thread computes them, after its Host writes in flight land)."""
        return self._call(self._collect_stats)

    def published_stats(self) -> dict:
        """The stats the engine's thread last published (at most STATS_PERIOD_S old while it runs, without the
        prefix cache's per-tier counts): read without waiting on that thread, for health checks and metrics."""
        return {**self._published, "failed": self._failed,
                "stats_age_s": round(time.monotonic() - self._published_at, 3)}

    def _collect_stats(self, detail: bool = True) -> dict:
        scheduler = self.scheduler.stats()
        c = scheduler["counters"]
        return {
            "requests": {"waiting": scheduler["waiting"], "running": scheduler["running"],
                         **{k: v for k, v in c.items() if k.startswith(("requests_", "finished_"))}},
            "tokens": {"prompt": c.get("prefill_tokens", 0), "generated": c.get("generated_tokens", 0)},
            "pages": scheduler["pages"],
            "kv": self.runner.kv_stats(),
            "parallel": self.runner.parallel_stats(),
            "slots": {"active": self.options.max_concurrency, "snapshot": self.options.device_snapshot_slots},
            "scheduler": {k: v for k, v in c.items() if not k.startswith(("requests_", "finished_"))},
            "speculative": scheduler["speculative"],
            "vision": self.scheduler.images.stats() if self.scheduler.images is not None else None,
            "prefix_cache": {**self.cache_manager.stats(detail),
                             **({"loaded": dataclasses.asdict(self.cache_load)} if self.cache_load else {})},
            # compiles a request waited on: the engine thread's, not the warm-up's or the background's
            "compiles_since_warmup": self._engine_compiles(),
            "compiling_in_background": self.runner.compiling,
            "failed": self._failed,
        }

    def check_ledger(self) -> None:
        """Raises AssertionError if any page, slot or Host slab is owned by nobody, or a pin leaked (run on
        the engine's thread)."""
        self._call(self.scheduler.check_ledger)

    def cache_record(self, request_id: str) -> dict | None:
        """The prefix-cache record of a recently finished request: cached_tokens, cached_prefix_tokens,
        source (root / tap / endpoint / boundary) and restored_host_bytes; None when unknown."""
        return self._call(lambda: self.cache_manager.record(request_id))

    def demote_device_cache(self) -> dict:
        """Drops the Device copy of every prefix-cache entry that also has a Host copy (blocks, tails, snapshot
        images), so later hits restore from the Host; returns {"pages": freed, "slots": freed}. Entries held by
        a running request, or with no Host copy, stay."""
        return self._call(self.cache_manager.demote_device)

    def reset_prefix_cache(self) -> dict:
        """Deletes every prefix-cache entry no running request holds, on the Device and the Host (vLLM's
        reset_prefix_cache, SGLang's flush_cache); returns how many {"blocks", "snapshots", "pages", "slots",
        "slabs"} went. Running requests keep what they hold and their output; later prompts start cold."""
        out = self._call(self.cache_manager.clear)
        log.info("prefix cache reset: %d blocks, %d snapshots deleted", out["blocks"], out["snapshots"])
        return out

    def inject_host_fault(self, kind: str, times: int = 1) -> None:
        """Fault injection (tests): the next `times` Host transfers of `kind` ("write" or "restore") raise.
        A failed transfer fails the engine: every request ends with finish_reason "error"."""
        host = self.cache_manager.host
        if host is None:
            raise ValueError("this engine has no Host tier")
        self._call(lambda: host.inject_fault(kind, times))


def _sampling_defaults(generation_config: str, checkpoint: Path) -> dict:
    """The sampling defaults option generation_config names: the checkpoint's generation_config.json (auto), none,
    or a file (or the folder holding one); logged when there are any."""
    if generation_config == "none":
        return {}
    path = checkpoint if generation_config == "auto" else Path(generation_config)
    if path.is_dir():
        path = path / "generation_config.json"
    defaults = generation_defaults(path)
    if defaults:
        log.info("sampling defaults from %s | %s", path, " ".join(f"{k} {v}" for k, v in defaults.items()))
    return defaults


__all__ = ["Engine", "EngineStoppedError", "InvalidRequestError", "Metrics", "PromptTooLongError",
           "RequestOutput", "StreamEvent", "Usage"]
