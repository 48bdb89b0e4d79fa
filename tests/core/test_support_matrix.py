"""Every cell of the README's support matrix, as a test (same code as `kvkit doctor --matrix`)."""

import pytest

import kvkit
from kvkit.doctor import BEGIN, END, check_cell, matrix_markdown
from kvkit.testing import MATRIX_ARCHS

REFUSED = {"gemma2": "soft-capping"}  # architecture -> why every policy refuses it
#: known bugs, reported in the README matrix as FAIL; strict, so fixing one makes this test fail
KNOWN_FAIL: dict = {}  # e.g. {("qwen3", "zipcache"): "why"}


@pytest.mark.parametrize("policy", kvkit.available_policies())
@pytest.mark.parametrize("arch", MATRIX_ARCHS)
def test_support_cell(arch, policy, request):
    if (arch, policy) in KNOWN_FAIL:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_FAIL[(arch, policy)], strict=True))
    status, detail = check_cell(arch, policy)
    if arch in REFUSED:
        assert status == "refused" and REFUSED[arch] in detail
    else:
        assert status == "ok", detail


def test_readme_matrix_is_generated():
    text = open("README.md", encoding="utf-8").read()
    assert BEGIN in text and END in text
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    for arch in MATRIX_ARCHS:
        assert f"| {arch} |" in table
    for policy in kvkit.available_policies():
        assert f"`{policy}`" in table, f"README support matrix misses {policy}: run `kvkit doctor --write-readme`"


def test_matrix_markdown_marks_failures():
    rows = [("llama", "full", "ok", "1.0x"), ("llama", "x", "FAIL", "boom"), ("t5", "full", "ok", "1.0x"), ("t5", "x", "refused", "no")]
    md = matrix_markdown(rows)
    assert "FAIL: boom" in md and "refused [1]" in md and "[1] no" in md
