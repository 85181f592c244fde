"""The README's one-screen workflow runs verbatim on the digits data, twice (the second resumes)."""

import io
import re
import runpy
import sys
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def workflow_block():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    matching = [block for block in blocks if "hooks.report_eval(trainer, train, test)" in block]
    assert len(matching) == 1
    return matching[0]


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y.astype(np.int32), test_size=0.2, random_state=0
    )
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def run_block(tmp_path, digits):
    script = tmp_path / "workflow.py"
    script.write_text(workflow_block())
    out = io.StringIO()
    with redirect_stdout(out):
        namespace = runpy.run_path(str(script), init_globals=dict(digits), run_name="__main__")
    return namespace, out.getvalue()


def test_the_readme_workflow_runs_as_written_and_resumes(tmp_path, digits, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["workflow.py"])
    namespace, printed = run_block(tmp_path, digits)
    assert namespace["trainer"].global_step == 2000
    results = re.findall(
        r"Results on (\w+):\n\tMean Loss \(#loss\): \S+\n\tAccuracy \(acc\): "
        r"(\d+\.\d\d)%",
        printed,
    )
    assert [name for name, _ in results] == ["train", "test"]
    assert float(results[1][1]) > 90.0
    # The evaluation's keys name the datasets, not a default "array".
    assert "eval/test/Accuracy" in namespace["loop"].history
    # Run again in the same directory: it resumes at step 2000 and reports the same numbers.
    namespace, again = run_block(tmp_path, digits)
    assert namespace["trainer"].global_step == 2000
    assert again.splitlines()[-6:] == printed.splitlines()[-6:]
