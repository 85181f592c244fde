"""Executes a notebook of docs/ in place and stores its outputs as a notebook viewer shows them.

    XLA_FLAGS= python docs/_ext/execute_notebook.py docs/examples/digits.ipynb

Runs every cell with nbclient in a scratch directory (files the notebook writes go nowhere
near the repository), then merges each cell's consecutive stream outputs and applies their
carriage returns, as Jupyter does on screen: a progress bar's text form is stored as its final
line, not as every refresh. Needs the docs extra (`pip install -e ".[docs]"`).
"""

import sys
import tempfile

import nbformat
from nbclient import NotebookClient
from nbconvert.preprocessors import CoalesceStreamsPreprocessor


def execute(path: str) -> None:
    """Executes the notebook at `path` and writes it back with its outputs."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as scratch:
        client = NotebookClient(notebook, timeout=600, resources={"metadata": {"path": scratch}})
        client.execute()
    notebook, _ = CoalesceStreamsPreprocessor().preprocess(notebook, {})
    nbformat.write(notebook, path)


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        execute(argument)
