"""The tutorials in doc/ cannot go stale: each doc/<name>.md has a companion script doc/<name>.py
that computes every number the text quotes and draws every figure it shows.

The convention every companion script follows:
    compute(fig_dir) -> dict {key: text}
runs the tutorial's experiments, saves its figures as PNG files into fig_dir (their names are the
ones the .md references, e.g. `attention_softmax.png`), and returns each number the text quotes,
formatted exactly as the text writes it. `python doc/<name>.py` runs compute(doc/) and prints the
numbers, so a learner can rerun the tutorial and regenerate its figures.

This test runs compute() into a temporary directory and checks, for each tutorial:
  - every returned number appears in the .md verbatim, tagged with its key as `<!--key-->value`
    (the tag is invisible when the markdown is rendered), so a changed result fails the test;
  - every figure the .md references (`](name.png)`) was drawn by the script, and is committed in doc/;
  - every tag in the .md is a key the script returned (no hand-written number wearing a tag).
Run: pytest tests/test_docs.py
"""

import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "doc")
TAG = re.compile(r"<!--([A-Za-z0-9_]+)-->")
FIGURE = re.compile(r"\]\(([A-Za-z0-9_\-]+\.png)\)")
TUTORIALS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(DOC, "*.py"))
                   if os.path.isfile(os.path.splitext(p)[0] + ".md"))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"doc_{name}", os.path.join(DOC, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_numbers_and_figures_match_its_script(name, tmp_path):
    with open(os.path.join(DOC, f"{name}.md")) as f:
        text = f.read()
    numbers = _load(name).compute(str(tmp_path))
    assert numbers, f"doc/{name}.py computed no numbers"
    for key, value in numbers.items():
        assert f"<!--{key}-->{value}" in text, f"doc/{name}.md does not quote {key} = {value!r} (as <!--{key}-->{value})"
    tags = set(TAG.findall(text))
    assert tags <= set(numbers), f"doc/{name}.md tags numbers its script does not compute: {sorted(tags - set(numbers))}"
    for figure in FIGURE.findall(text):
        assert os.path.isfile(tmp_path / figure), f"doc/{name}.py did not draw {figure}"
        assert os.path.isfile(os.path.join(DOC, figure)), f"doc/{figure} is referenced but not committed"


def test_every_tutorial_has_a_script():
    expected = {"attention", "classifier", "adamw", "mixed_precision", "data", "gelu_and_matmul",
                "from_numpy_to_cuda", "llmc_map"}
    have = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(DOC, "*.md"))}
    missing = sorted(n for n in expected & have if n not in TUTORIALS)
    assert not missing, f"tutorials without a companion doc/<name>.py: {missing}"
