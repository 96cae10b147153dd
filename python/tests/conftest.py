"""Shared fixtures: the repository's models and examples, and the CLI to compare against."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
EXAMPLES = ROOT / "examples"


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tumble_bin() -> str | None:
    """The CLI to compare with: $TUMBLE_BIN, else a build in the repository's target folder."""
    env = os.environ.get("TUMBLE_BIN")
    if env:
        return env
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for profile in ("release", "debug"):
        exe = target / profile / "tumble"
        if exe.is_file():
            return str(exe)
    return shutil.which("tumble")


@pytest.fixture(scope="session")
def cli():
    exe = tumble_bin()
    if exe is None:
        pytest.skip("no tumble CLI built (set TUMBLE_BIN or run cargo build)")

    def run(*args: str) -> list:
        out = subprocess.run(
            [exe, *args], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    return run
