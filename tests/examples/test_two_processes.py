"""examples/two_processes.py launches 2 processes on this machine and trains the digits."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_processes.py"


def test_two_processes_train_checkpoint_and_agree(tmp_path):
    pytest.importorskip("sklearn")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher gives each process its devices
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "60", "--dir", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracies = dict(re.findall(r"^process (\d): test accuracy (\S+)$", result.stdout, re.M))
    assert sorted(accuracies) == ["0", "1"], result.stdout[-2000:]
    assert accuracies["0"] == accuracies["1"]  # one evaluation of the whole test split
    assert float(accuracies["0"]) > 0.8
    assert (tmp_path / "checkpoints" / "60").is_dir()
