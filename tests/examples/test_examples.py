"""The examples run as a newcomer runs them: as scripts, in processes of their own.

The README's main job (digits, trained then resumed) starts a fresh interpreter each time;
the others run as children forked from the worker's pre-imported interpreter
(`tests/zygote.py`: the same script as `__main__`, its arguments, directory and environment,
the interpreter's own exit), which saves each ~1.4 s of imports.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _environment():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the examples choose their own device count
    return env


def _run(args, cwd, timeout=300, zygote=None):
    """Runs `python args...` in a fresh interpreter, or forked from `zygote`."""
    if zygote is not None:
        return zygote.run(args, cwd=str(cwd), timeout=timeout, env=_environment())
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_digits_trains_resumes_and_reports(tmp_path):
    pytest.importorskip("sklearn")
    first = _run(
        [str(EXAMPLES / "digits.py"), "--steps", "300", "--dir", str(tmp_path), "--no-progress"],
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    last_line = first.stdout.strip().splitlines()[-1]
    assert last_line.startswith("test accuracy: 0.9"), first.stdout[-2000:]
    assert "Results on test:" in first.stdout
    assert "resumed" not in first.stdout

    second = _run(
        [str(EXAMPLES / "digits.py"), "--steps", "350", "--dir", str(tmp_path), "--no-progress"],
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 300" in second.stdout
    assert second.stdout.strip().splitlines()[-1].startswith("test accuracy: 0.")
    assert any((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert any((tmp_path / "plots").glob("*.png"))


def test_digits_run_again_after_early_stopping_says_it_ended_and_reports_the_same(
    zygote_server, tmp_path
):
    pytest.importorskip("sklearn")
    # A learning rate of 0 keeps the validation loss the same at every evaluation: early
    # stopping (patience 5, an evaluation every 100 steps) stops at step 600 on any machine.
    args = [str(EXAMPLES / "digits.py"), "--learning-rate", "0", "--dir", str(tmp_path)]
    first = _run([*args, "--no-progress"], cwd=tmp_path, zygote=zygote_server)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "; stopped at step 600\n" in first.stdout, first.stdout[-2000:]
    again = _run([*args, "--no-progress"], cwd=tmp_path, zygote=zygote_server)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Warning" not in again.stderr, again.stderr[-3000:]  # no RuntimeWarning: reset()
    lines = again.stdout.splitlines()
    assert lines[:3] == [
        f"resumed from step 600 in {tmp_path}",
        "early_stopping(eval/val/mean_loss): this training already ended: stopped early at "
        "step 600 (eval/val/mean_loss did not improve on "
        + first.stdout.split("did not improve on ")[1].split(" (step 100)")[0]
        + " (step 100) in 5 checks); best step 100. Nothing is trained (reset() on the hook "
        "trains on)",
        "early_stopping(eval/val/mean_loss): restored the parameters of step 100",
    ], again.stdout
    # Then it reports what the first run reported: the best step's parameters.
    report = first.stdout[first.stdout.index("Results on train:") :]
    assert again.stdout.endswith(report), (first.stdout, again.stdout)


def test_digits_on_four_simulated_devices(zygote_server, tmp_path):
    pytest.importorskip("sklearn")
    result = _run(
        [
            str(EXAMPLES / "digits.py"),
            "--steps",
            "100",
            "--devices",
            "4",
            "--dir",
            str(tmp_path),
            "--no-progress",
        ],
        cwd=tmp_path,
        zygote=zygote_server,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("test accuracy: 0.")


def test_custom_setup_compiles_once_per_spec(zygote_server, tmp_path):
    result = _run(
        [str(EXAMPLES / "custom_setup.py"), "--steps", "40"], cwd=tmp_path, zygote=zygote_server
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("compiled")]
    assert len(compiled) == 2, result.stdout
    assert "'short': 19 cache hits" in result.stdout
    assert "'long': 19 cache hits" in result.stdout


def test_keras_style_trains_with_validation_checkpoints_log_and_early_stopping(
    zygote_server, tmp_path
):
    pytest.importorskip("sklearn")
    result = _run(
        [str(EXAMPLES / "keras_style.py"), "--epochs", "4", "--dir", str(tmp_path)], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("stopped after epoch 4; val accuracy: 0.9"), result.stdout[-2000:]
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0] == "metric,short,type,step,value"
    val_steps = sorted({int(row.split(",")[3]) for row in rows[1:] if row.startswith("eval/val/")})
    assert len(val_steps) == 4  # one validation per epoch
    assert len(list((tmp_path / "checkpoints").glob("[0-9]*"))) >= 1


def test_digits_with_flax_nnx_mnist_cnn_reaches_97_percent(zygote_server, tmp_path):
    pytest.importorskip("sklearn")
    result = _run(
        [
            str(EXAMPLES / "digits.py"),
            "--model",
            "nnx",
            "--steps",
            "500",
            "--dir",
            str(tmp_path),
            "--no-progress",
        ],
        cwd=tmp_path,
        zygote=zygote_server,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(result.stdout.strip().splitlines()[-1].split(":")[1])
    assert accuracy >= 0.97, result.stdout[-2000:]


def test_digits_grain_trains_and_resumes_exactly(zygote_server, tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("grain")
    script = str(EXAMPLES / "digits_grain.py")
    log = tmp_path / "uninterrupted.log"
    uninterrupted = zygote_server.start(  # in parallel with the interrupted runs
        [script, "--steps", "350", "--dir", str(tmp_path / "uninterrupted")],
        out=log,
        err=tmp_path / "uninterrupted.err",
        cwd=str(tmp_path),
        env=_environment(),
    )
    first = _run(
        [script, "--steps", "300", "--dir", str(tmp_path / "run")],
        cwd=tmp_path,
        zygote=zygote_server,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1].startswith("test accuracy: 0.9"), first.stdout
    assert "resumed" not in first.stdout

    second = _run(
        [script, "--steps", "350", "--dir", str(tmp_path / "run")],
        cwd=tmp_path,
        zygote=zygote_server,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 300" in second.stdout
    assert "differ from an uninterrupted run" not in second.stderr, second.stderr[-3000:]
    returncode = uninterrupted.finish(timeout=300)
    assert returncode == 0, (tmp_path / "uninterrupted.err").read_text()[-3000:]
    output = log.read_text()
    # The same batches after the resume: the same results at step 350.
    at_350 = output[output.index("Step 350:") :]
    assert second.stdout[second.stdout.index("Step 350:") :] == at_350


def test_transformer_lm_learns_the_standard_library_samples_and_resumes(zygote_server, tmp_path):
    script = str(EXAMPLES / "transformer_lm.py")
    small = ["--width", "32", "--layers", "1", "--heads", "2", "--context", "32"]
    small += ["--batch-size", "16", "--max-chars", "300000", "--val-batches", "2"]
    small += ["--eval-every", "16", "--steps-per-execution", "4", "--learning-rate", "1e-2"]
    small += ["--dir", str(tmp_path), "--no-progress"]
    first = _run([script, "--steps", "32", *small], cwd=tmp_path, zygote=zygote_server)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.strip().splitlines()
    assert "resumed" not in first.stdout
    # Two evaluations (steps 16 and 32), the loss falling, well below a uniform guess
    # over the 96 characters (ln 96 = 4.56 nats).
    losses = [float(line.split(":")[1]) for line in lines if "Mean Loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0] < 4.0, first.stdout[-2000:]
    final = float(lines[-2].removeprefix("validation loss: "))
    assert abs(final - losses[1]) < 0.01, lines[-2]
    assert lines[-1].startswith("def "), lines[-1]  # the sampled line, from the prompt

    second = _run([script, "--steps", "48", *small], cwd=tmp_path, zygote=zygote_server)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 32" in second.stdout
    assert second.stdout.strip().splitlines()[-2].startswith("validation loss: ")
