"""Multi-process data parallelism: 2 processes x 2 CPU devices == 1 device, same batches."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one_device(tmp_path):
    port = str(_free_port())
    outputs = [tmp_path / f"process{i}.npz" for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), port, "2", str(i), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outputs)
    ]
    reference = tmp_path / "reference.npz"
    subprocess.run(
        [sys.executable, str(WORKER), "0", "0", "0", str(reference)], check=True, timeout=240
    )
    logs = []
    for worker in workers:
        out, _ = worker.communicate(timeout=240)
        logs.append(out)
        assert worker.returncode == 0, out
    assert all("4 devices, step 5" in log for log in logs), logs
    expected = np.load(reference)
    for out in outputs:
        got = np.load(out)
        assert got.files == expected.files
        for name in expected.files:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
