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
    except the rounding-level numbers (below), which are checked to their order of magnitude;
  - every figure the .md references (`](name.png)`) was drawn by the script, and is committed in doc/;
  - every tag in the .md is a key the script returned (no hand-written number wearing a tag).

Rounding-level numbers: a difference or error between two computations that agree up to rounding
(`flash_fwd_diff_f32 = 4.2e-07`, a finite-difference error of 5.6e-10) is a sum of rounding errors,
and its digits depend on the CPU's SIMD width (NumPy's exp and sums take other paths with AVX-512
than with AVX2) and on the BLAS kernels: a fresh install elsewhere computes 3.0e-07 for the
4.2e-07 above. Such a number, a key naming a difference or error (ROUNDING_KEY) whose value is in
scientific notation, must agree with the text to within a factor of ROUNDING_FACTOR either way; a
quoted zero (`0.0e+00`, "bitwise equal") stays exact. Every other number is exact on any machine.
(Seen varying here with OPENBLAS_CORETYPE=Prescott and NPY_DISABLE_CPU_FEATURES=X86_V3: only keys
of that kind.)
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
ROUNDING_KEY = re.compile(r"(diff|err)(_f32|_f64)?$|_pass_\d+$|^row_sum_max$")
SCIENTIFIC = re.compile(r"^-?\d(\.\d+)?e[-+]\d+$")
ROUNDING_FACTOR = 10.0
FIGURE = re.compile(r"\]\(([A-Za-z0-9_\-]+\.png)\)")
TUTORIALS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(DOC, "*.py"))
                   if os.path.isfile(os.path.splitext(p)[0] + ".md"))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"doc_{name}", os.path.join(DOC, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_rounding_level(key, value):
    """True for a nonzero difference or error written in scientific notation (see the docstring)."""
    return bool(ROUNDING_KEY.search(key) and SCIENTIFIC.match(value)) and float(value) != 0.0


def quoted_value(text, key):
    """The number written after `<!--key-->` (digits, point, exponent), or None."""
    match = re.search(rf"<!--{key}-->(-?\d+(?:\.\d+)?(?:e[-+]\d+)?)", text)
    return match.group(1) if match else None


def same_order_of_magnitude(quoted, computed):
    """Both nonzero and within ROUNDING_FACTOR of each other."""
    try:
        a, b = abs(float(quoted)), abs(float(computed))
    except ValueError:
        return False
    return a > 0 and b > 0 and max(a, b) / min(a, b) <= ROUNDING_FACTOR


def test_rounding_level_rule():
    assert is_rounding_level("flash_fwd_diff_f32", "3.0e-07")
    assert is_rounding_level("fd_rel_err", "5.6e-10") and is_rounding_level("one_pass_100", "4e-03")
    assert not is_rounding_level("update_maxdiff", "0.0e+00")          # bitwise equal stays exact
    assert not is_rounding_level("tying_cls_only_err", "0.87")         # a real error, not rounding
    assert not is_rounding_level("sched_step0", "6.0e-06")             # a formula's value
    assert same_order_of_magnitude("4.2e-07", "3.0e-07")
    assert not same_order_of_magnitude("4.2e-07", "3.0e-05") and not same_order_of_magnitude("4.2e-07", "0.0e+00")
    assert quoted_value("| <!--k-->4.2e-07 | x", "k") == "4.2e-07" == quoted_value("<!--k-->4.2e-07:", "k")


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_numbers_and_figures_match_its_script(name, tmp_path):
    with open(os.path.join(DOC, f"{name}.md")) as f:
        text = f.read()
    module = _load(name)
    reason = getattr(module, "unavailable_reason", lambda: None)()     # e.g. no browser for its screenshots
    if reason:
        pytest.skip(f"doc/{name}.py cannot run here: {reason}")
    numbers = module.compute(str(tmp_path))
    assert numbers, f"doc/{name}.py computed no numbers"
    for key, value in numbers.items():
        if is_rounding_level(key, value):
            quoted = quoted_value(text, key)
            assert quoted is not None and same_order_of_magnitude(quoted, value), \
                f"doc/{name}.md quotes {key} = {quoted!r}, not within {ROUNDING_FACTOR:g}x of the computed {value!r}"
            continue
        assert f"<!--{key}-->{value}" in text, f"doc/{name}.md does not quote {key} = {value!r} (as <!--{key}-->{value})"
    tags = set(TAG.findall(text))
    assert tags <= set(numbers), f"doc/{name}.md tags numbers its script does not compute: {sorted(tags - set(numbers))}"
    for figure in FIGURE.findall(text):
        assert os.path.isfile(tmp_path / figure), f"doc/{name}.py did not draw {figure}"
        assert os.path.isfile(os.path.join(DOC, figure)), f"doc/{figure} is referenced but not committed"


def test_every_tutorial_has_a_script():
    expected = {"attention", "classifier", "adamw", "mixed_precision", "data", "gelu_and_matmul",
                "from_numpy_to_cuda", "llmc_map", "llama3"}
    have = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(DOC, "*.md"))}
    missing = sorted(n for n in expected & have if n not in TUTORIALS)
    assert not missing, f"tutorials without a companion doc/<name>.py: {missing}"
