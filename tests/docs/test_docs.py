"""The documentation's code runs: every runnable python block of docs/ and README.md, in order.

The convention (docs/contributing.md): a ```python block runs unless the comment line right
above it starts with `<!-- not-run`, followed by the reason. The blocks of one page run in order
in one namespace, in a fresh working directory, after a preamble that defines the digits arrays
`x_train`, `y_train`, `x_val`, `y_val`, `x_test`, `y_test` (scikit-learn's bundled digits,
scaled to [0, 1], float32 inputs and int32 labels). A failure's traceback names the page and
its line. Also: the API pages name every public name, the README's links resolve, the Getting
started page shows the README's workflow, the notebook holds its outputs, and `mkdocs build
--strict` passes where the docs extra is installed.
"""

import html
import importlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
SKIP = "<!-- not-run"
WORKFLOW_MARKER = "hooks.report_eval(trainer, train, test)"


@dataclass(frozen=True)
class Block:
    """One ```python block of a page: its source, its first line's number, whether it runs."""

    source: str
    line: int
    runs: bool


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].splitlines()
        comments = []
        while before and before[-1].startswith("<!--"):  # the comment lines right above
            comments.append(before.pop())
        line = text.count("\n", 0, match.start(1)) + 1
        runs = not any(comment.startswith(SKIP) for comment in comments)
        found.append(Block(match.group(1), line, runs))
    return found


def runnable_pages() -> list[Path]:
    return [page for page in PAGES if any(block.runs for block in blocks(page))]


@pytest.fixture(scope="module")
def digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y.astype(np.int32), test_size=0.2, random_state=0
    )
    x_train, x_val, y_train, y_val = train_test_split(
        x_train, y_train, test_size=0.2, random_state=0
    )
    return {
        "x_train": x_train,
        "y_train": y_train,
        "x_val": x_val,
        "y_val": y_val,
        "x_test": x_test,
        "y_test": y_test,
    }


# Pages whose examples train over 4 devices (a mesh): not on one GPU (pytest --accelerator).
FOUR_DEVICE_PAGES = {"docs/guides/scale.md"}


def page_cases() -> list:
    return [
        pytest.param(page, marks=pytest.mark.cpu_devices)
        if str(page.relative_to(ROOT)) in FOUR_DEVICE_PAGES
        else page
        for page in runnable_pages()
    ]


@pytest.mark.parametrize("page", page_cases(), ids=lambda page: str(page.relative_to(ROOT)))
def test_the_page_runs_as_written(page, digits, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__", **{k: v.copy() for k, v in digits.items()}}
    printed = io.StringIO()
    for block in blocks(page):
        if block.runs:
            # Padded so that a traceback's line number is the page's.
            code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
            with redirect_stdout(printed):
                exec(code, namespace)  # noqa: S102 (our own documentation)


def test_the_convention_is_followed():
    # Every page has runnable code or says why not; a skipped block names its reason.
    for page in PAGES:
        text = page.read_text()
        for comment in re.findall(r"^<!-- not-run(.*?)-->$", text, re.M):
            assert comment.startswith(": ") and len(comment) > 5, (page, comment)
    assert len(runnable_pages()) >= 10


def test_getting_started_shows_the_readme_workflow():
    def workflow(page: Path) -> list[str]:
        return [b.source for b in blocks(page) if WORKFLOW_MARKER in b.source]

    readme = workflow(ROOT / "README.md")
    assert len(readme) == 1
    assert workflow(DOCS / "index.md") == readme


API_PAGES = {
    "loopax": "loopax",
    "loopax.hooks": "hooks",
    "loopax.losses": "losses",
    "loopax.metrics": "metrics",
    "loopax.optimizers": "optimizers",
    "loopax.testing": "testing",
    "loopax.loop": "loop",
    "loopax.data": "data",
    "loopax.trainer": "trainer",
}


@pytest.mark.parametrize("package", sorted(API_PAGES))
def test_the_api_page_shows_every_public_name(package):
    text = (DOCS / "api" / f"{API_PAGES[package]}.md").read_text()
    top = set(importlib.import_module("loopax").__all__)
    for name in importlib.import_module(package).__all__:
        rendered = f"::: {package}.{name}\n" in text
        subpackage = package == "loopax" and f"[`loopax.{name}`]({name}.md)" in text
        linked = name in top and f"[`loopax.{name}`][loopax.{name}]" in text
        assert rendered or subpackage or linked, f"{package}.{name} is not on its API page"


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://|#)([^)#]+)(?:#[^)]*)?\)", text)
    assert any(target.startswith("docs/") for target in targets)
    for target in targets:
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_the_notebook_is_stored_executed():
    notebook = json.loads((DOCS / "examples" / "digits.ipynb").read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert code and all(cell["execution_count"] for cell in code)
    text = json.dumps([cell["outputs"] for cell in code])
    assert "Results on test" in text and "error" not in {
        output["output_type"] for cell in code for output in cell["outputs"]
    }
    # The progress bar's text form is stored as a viewer shows it: its final state, one line.
    (bar,) = [
        "".join(output["text"])
        for cell in code
        for output in cell["outputs"]
        if output.get("name") == "stderr"
    ]
    assert "\r" not in bar and bar.count("\n") <= 1 and "500" in bar, bar


def site_config():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def signature_options(config):
    plugin = next(p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    return plugin["mkdocstrings"]["handlers"]["python"]["options"]


def test_the_site_formats_signatures_and_loads_no_web_font():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["docs"]
    names = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in extra}
    # mkdocstrings formats a signature into lines only when Black or Ruff is installed:
    # without one, a long signature is one line cut at the box's edge.
    assert names & {"ruff", "black"}, sorted(names)
    config = site_config()
    options = signature_options(config)
    assert options["separate_signature"] is True and isinstance(options["line_length"], int)
    # Material's default loads Roboto from Google's servers on every page.
    assert config["theme"]["font"] is False


DOCS_EXTRA = (
    "mkdocs",
    "material",
    "mkdocstrings",
    "mkdocstrings_handlers.python",
    "mkdocs_jupyter",
)


@pytest.mark.skipif(
    not all(importlib.util.find_spec(module.split(".")[0]) for module in DOCS_EXTRA),
    reason='the docs extra is not installed (pip install -e ".[docs]")',
)
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "api" / "hooks" / "index.html").exists()
    pages = {page: page.read_text() for page in tmp_path.rglob("*.html")}
    web_fonts = [str(p) for p, text in pages.items() if re.search(r"fonts\.g\w+\.com", text)]
    assert not web_fonts, web_fonts
    # Every API signature is laid out in lines that fit the box: none is cut.
    line_length = signature_options(site_config())["line_length"]
    signatures = [
        html.unescape(re.sub(r"<[^>]+>", "", block))
        for page, text in pages.items()
        if "api" in page.parts
        for block in re.findall(
            r'<div class="doc-signature highlight"><pre><span></span><code>(.*?)</code>',
            text,
            re.S,
        )
    ]
    assert len(signatures) > 100
    too_long = [line for s in signatures for line in s.splitlines() if len(line) > line_length]
    assert not too_long, too_long
    progress_bar = next(s for s in signatures if s.startswith("progress_bar("))
    assert "\n    refresh_seconds: float = 0.2,\n" in progress_bar, progress_bar
