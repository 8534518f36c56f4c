"""scripts/train_tiny_mtp.py: its losses are the cross-entropies of the engine's forward and MTP layer (the shifts
by one and two tokens), its train step lowers both, and the checkpoint it writes loads back as the trained params,
MTP layer included."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.config import ModelConfig
from ninfer_jax.model.loader import load_checkpoint
from ninfer_jax.model.mtp import mtp_forward, mtp_logits
from ninfer_jax.model.qwen3_5 import logits

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny_mtp.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny_mtp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cross_entropy(logits, labels):
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    return lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]


def test_training_lowers_both_losses_and_writes_a_checkpoint_with_its_mtp_layer(tmp_path):
    train = _script()
    # 128 tokens: two GDN chunks; 256 rows in logit chunks of 64: four
    config = train.tiny.preset_config("tiny-trained", layout="text", hidden_size=16, intermediate_size=32,
                                      vocab_size=256)
    cfg = ModelConfig.from_dict(config)
    params = train.init_params(train.tiny.write_random_checkpoint(tmp_path / "random", config))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.vocab_size, (2, 130)).astype(np.int32)

    # The oracle: the model's whole-sequence forward and its MTP layer (both checked against transformers elsewhere)
    hidden_of = jax.jit(train.forward_hidden, static_argnums=(1, 2))
    main, mtp = [], []
    for row in batch:
        tokens, nxt, after = row[:-2], row[1:-1], row[2:]
        hidden = hidden_of(params, cfg, train.ops.REFERENCE, jnp.asarray(tokens))
        main.append(_cross_entropy(logits(params, hidden), nxt).mean())
        mtp.append(_cross_entropy(mtp_logits(params, mtp_forward(params, cfg, hidden, nxt)), after).mean())

    optimizer = train.make_optimizer(0.1)
    step = train.make_train_step(cfg, optimizer, 0.3, jnp.float32, chunk=64)
    state = (params, optimizer.init(params))
    losses = []
    for _ in range(6):
        state, pair = step(state, batch, jnp.float32(1e-2))
        losses.append([float(x) for x in pair])
    np.testing.assert_allclose(losses[0], [np.mean(main), np.mean(mtp)], rtol=1e-5)
    assert losses[-1][0] < losses[0][0] - 0.5 and losses[-1][1] < losses[0][1] - 0.5, losses

    trained = state[0]
    written = train.write(tmp_path / "ckpt", config, trained, None, dtype="float32")
    loaded_cfg, loaded = load_checkpoint(written, dtype="float32")
    assert loaded_cfg == cfg and loaded.mtp is not None
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), trained, loaded)
    assert all(jax.tree.leaves(same))
