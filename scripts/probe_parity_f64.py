"""How far our fp32 logits and HF transformers' fp32 logits each are from HF in float64, on the random tiny
checkpoints the parity tests use. Explains the 1e-4 bound: both fp32 implementations sit equally far from the
float64 answer, so their difference measures conditioning, not a bug.

    .venv/bin/python scripts/probe_parity_f64.py            # seeds 12, 13, 14 of tiny-dense
"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import hf_model, oracle_config  # noqa: E402

from ninfer_jax.model import forward, load_checkpoint  # noqa: E402
from ninfer_jax.model.tiny import write_random_checkpoint  # noqa: E402


def main() -> int:
    import tempfile

    for seed in (12, 13, 14):
        d = write_random_checkpoint(Path(tempfile.mkdtemp()) / "ckpt", oracle_config("tiny-dense", "text"), seed=seed)
        cfg, params = load_checkpoint(d, "float32")
        toks = np.random.default_rng(seed).integers(0, 1024, 203)
        ours = np.asarray(forward(params, cfg, toks))
        model = hf_model(d, "text")
        with torch.no_grad():
            f32 = model(input_ids=torch.tensor(toks)[None]).logits[0].numpy()
            f64 = model.double()(input_ids=torch.tensor(toks)[None]).logits[0].numpy()
        print(f"seed {seed}: ours-f64 {np.abs(ours - f64).max():.2e} | hf32-f64 {np.abs(f32 - f64).max():.2e} | "
              f"ours-hf32 {np.abs(ours - f32).max():.2e} | max |logit| {np.abs(f64).max():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
