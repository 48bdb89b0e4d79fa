"""Shared test fixtures: tiny random models of several architectures and the bundled real model."""

import os

# Triton kernels run under the interpreter on CPU; must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

from kvkit.testing import tiny_model  # noqa: E402,F401

#: tests over ~1 s on 2 CPU cores (scripts/slow_tests.py writes the list from a full run's JUnit report)
_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow.txt")


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test listed in ``tests/slow.txt`` (besides those marked in their files: the bundled real
    model), so ``pytest -m "not slow"`` is the fast loop. A listed test that no longer exists is ignored."""
    with open(_SLOW_LIST, encoding="utf-8") as f:
        slow = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2-135M-Instruct (loaded once per session)."""
    from kvkit.models import load_default

    return load_default()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (2048-token context) saved with the real SmolLM2 tokenizer, for CLI tests that load a
    model folder (modules may override it)."""
    from kvkit.models import load_tokenizer

    tok = load_tokenizer("default")
    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model (``kvkit run``'s and the eval commands' loaders) raises :class:`kvkit.testing.ModelLoaded`:
    for tests that bad input is refused before any model loads."""
    from kvkit.evals.commands import runs as eval_runs
    from kvkit.testing import ModelLoaded

    def refuse(*a, **k):
        raise ModelLoaded("the model was loaded before the bad input was refused")

    monkeypatch.setattr(eval_runs, "load", refuse)
    monkeypatch.setattr("kvkit.models.load", refuse)


@pytest.fixture
def caldir(tmp_path, monkeypatch):
    """An empty calibration folder searched first (``KVKIT_CALIBRATION_DIR``), the user folder moved into
    ``tmp_path`` too (``XDG_CACHE_HOME``), and the calibration store's cache cleared before and after: for tests that
    write (hostile) calibration files for a model."""
    from kvkit import calibration

    d = tmp_path / "cal"
    d.mkdir()
    monkeypatch.setenv("KVKIT_CALIBRATION_DIR", str(d))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calibration._CACHE.clear()
    yield d
    calibration._CACHE.clear()


@pytest.fixture
def fresh_dynamo():
    """A clean torch.compile state around a test (compiled graphs, recompile counters): compile tests use it
    (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``) so their graph counts are their own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
