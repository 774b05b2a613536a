"""Train a GPT with ZeRO stage 0-3 on every device there is: `python train.py --stage 3`.

With no accelerator the CPU is split into simulated devices (8 unless --devices says
otherwise), so every shard is its own buffer and every collective really runs. The run is
composed in ``zero_jax/gpt/run.py`` (also installed as the ``zero-jax-train`` command) of the
library's plan, step, checkpoints and loop services; ``python train.py --help`` lists the flags.
"""

import sys

from zero_jax.gpt.cli import build, load_config, parse_args
from zero_jax.gpt.run import main

__all__ = ["build", "load_config", "main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
