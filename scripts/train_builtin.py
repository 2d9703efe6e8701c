"""Train the built-in model: the same recipe as `ringserve train-builtin` (see train/recipe.py).

    python scripts/train_builtin.py OUT_DIR [--steps N] [--deb FILE | --html-dir DIR] …
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.recipe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
