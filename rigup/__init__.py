"""rigup: provision consumer-GPU Ubuntu boxes into pinned, verified vLLM serving rigs."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
