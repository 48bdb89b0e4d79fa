"""The README's quickstart runs as written on the bundled model, and the installed transformers raises no
deprecation warning from it (the cache is passed the way the installed release prefers)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_is_the_readmes_first_python_block():
    code = _quickstart()
    assert "kvkit.patched(" in code and "apply_chat_template" in code


@pytest.mark.slow
def test_quickstart_runs_on_the_bundled_model_without_a_deprecation_warning(monkeypatch, capsys):
    pytest.importorskip("gguf")
    monkeypatch.chdir(ROOT)
    code = _quickstart().replace("max_new_tokens=48", "max_new_tokens=4")
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(?!transformers|kvkit)")
        exec(compile(code, "README.md quickstart", "exec"), scope)
    model = scope["model"]
    assert getattr(model.config, "_attn_implementation", None) != "kvkit", "the with-block left the model patched"
    assert capsys.readouterr().out.strip(), "the quickstart printed no answer"


def _readme_commands() -> list[list[str]]:
    import shlex

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Command line", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line.split("#", 1)[0])[1:] for line in block.splitlines() if line.startswith("kvkit ")]


def test_every_readme_command_line_parses(tmp_path, monkeypatch):
    """Each ``kvkit ...`` line of the README's command-line section is accepted by the parser as written (nothing
    runs: the arguments are parsed only). `--device cuda` is checked up front, so it is swapped for cpu here."""
    from kvkit.cli import _command_of, build_parser

    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("text")
    lines = _readme_commands()
    assert len(lines) >= 8
    for argv in lines:
        argv = ["cpu" if a == "cuda" else a for a in argv]
        args = build_parser(_command_of(argv)).parse_args(argv)
        assert hasattr(args, "func"), argv
