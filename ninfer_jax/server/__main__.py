"""`python -m ninfer_jax.server`: the same as `ninfer-serve`."""

import sys

from .cli import main

sys.exit(main())
