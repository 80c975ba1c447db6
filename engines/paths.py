"""Where the repository's artifacts are (no torch import: the CLI checks paths before loading models)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WARM_START_DIR = REPO_ROOT / "artifacts" / "warm_start" / "addition"
