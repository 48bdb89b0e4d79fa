"""``chelsea``: Chelsea (arXiv:2506.11418) -- chunked soft-matching clustering of the KV cache.

The paper has no public code; this follows the paper's description. The sequence is split into
chunks of ``chunk_size`` tokens. Inside a chunk, per (row, KV head), the slots are split alternately
into two sets A (even) and B (odd); every slot of A is matched to its most similar key in B (cosine
similarity of the post-RoPE keys), and the ``r`` most similar pairs are merged into centroids: the
size-weighted mean of their keys and of their values (ToMe's bipartite soft matching). This repeats
until the chunk holds ``ceil(ratio * chunk_size)`` slots (a 64-token chunk at ratio 0.2 takes three
rounds: 64 -> 32 -> 16 -> 13). Each slot carries its cluster size; with ``size_bias`` attention adds
``log(size)`` to a merged key's score (ToMe's proportional attention, kvkit's option: a cluster then
weighs as many identical tokens) through :func:`kvkit.stores.attend_slots` (on the Triton path the
log-weight of the fused ``kvkit.kernels.decode`` kernel).

What is merged (kvkit's choices, not the paper's, which does not say): the first ``sink`` tokens of
every row and the most recent ``window`` tokens stay exact; only *complete* chunks between them are
merged (a partial chunk waits until it is complete). Chunks are counted from the first real token of
each row, so a left-padded row is clustered exactly as the same prompt alone. Merging runs right after
the prefill and, during decoding, at the start of ``update`` once ``merge_interval`` new tokens have
arrived (on the committed tokens only, so ``crop`` of the newest tokens stays exact).

Beyond the paper (kvkit, ``protect``, on by default: ``protect=0`` is the paper's matching): the tokens the prompt's
last ``window`` queries attend to most are kept exact. The paper's matching merges the most similar keys first, and
the keys of a run of like tokens (the digits of a number) are each other's nearest neighbours; with ``protect = f``
the ``ceil(f * chunk_size)`` slots of each chunk with the highest observation-window attention (SnapKV's score:
summed over the window's queries, pooled along the tokens -- ``protect_kernel`` / ``protect_pooling`` /
``protect_window`` -- and averaged over each KV head's query group) are taken out of the matching and the rest merges
down to ``ceil(ratio * chunk_size) - ceil(f * chunk_size)`` slots, so a chunk still keeps exactly
``ceil(ratio * chunk_size)`` slots (same memory). Scores come from the prefill; chunks of generated tokens (merged
during decoding) have no score and protect their earliest tokens. The window score ranks what the prompt's last
queries attend to (with the question at the end of the prompt: what the question needs); the chunk size and the
pooling are per-model calibrated options (``kvkit calibrate chelsea``, used only when ``protect`` > 0); the fallbacks
are 64-token chunks and SnapKV's max-pooled kernel 7, centered. The default (``protect=None``) protects
``PROTECT_SHARE`` of the slots a chunk keeps (``protect = PROTECT_SHARE * ratio``; at most all but one of them;
how it was chosen: results/ruler/README.md); ``protect=0`` (or ``calibrated=False``) is the paper.

Question-agnostic protection (kvkit, ``protect_score="reconstruct"``): without the question the observation window is
the context's last sentence, which need not attend to what a later question asks for. Then the protection score is
KVzip's (arXiv:2505.23416, :mod:`kvkit.stores.reconstruct`): after the exact prefill the context is fed again in
chunks of ``recon_chunk`` tokens on top of the cache (each rolled back exactly), and a slot scores the largest
attention probability any repeat query of its KV head's group pays it: the tokens the model needs to reproduce the
context. Merging waits for that pass (kvkit's forward hook on the patched model, ``Policy.after_forward``); the score
is not pooled (it is per token already). Cost: one more pass over the context in which each chunk's queries read
every held slot, like ``kvzip``. The tokens a context needs exact are not spread evenly over its chunks;
``protect_scope="context"`` ranks the protected slots per KV head over all the chunks merged together (KVzip ranks a
head's tokens over the whole context) and each chunk merges its other tokens into the same number of centroids
(:func:`kvkit.stores.merge.merge_free`), so a KV head holds the same slots.

The merge math (bipartite soft matching, the protected variants, the slot gathers) is in :mod:`kvkit.stores.merge`;
this module holds the options, their checks and :class:`ChelseaStore`, which decides what to merge and when.

Slot positions (for causal masking): a centroid's position is the position of its latest member.
Only committed tokens older than the recent window are merged, so every centroid lies strictly in
the past of any later query and the causal mask never hides it.

Memory: a complete chunk of L tokens becomes exactly ``ceil(ratio * L)`` slots per KV head; a layer
holds ``sink + window + (< L unmerged) + ceil(ratio * L) * complete_chunks`` slots (+ new tokens
before the next merge). Each slot costs keys + values + an int32 position and an int32 size per head (+ an fp32
protection score with ``protect`` > 0). With ``protect_scope="context"`` the chunks of one merge hold different
numbers of slots, their total per KV head the same ``ceil(ratio * L) * complete_chunks``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvkit.calibration import resolve
from kvkit.policies.base import Policy, check_choice, check_fraction, check_odd_kernel, check_positive_int
from kvkit.policies.chelsea_store import (  # noqa: F401  (re-exported: kvkit.policies.chelsea.<name> as before)
    ChelseaStore,
)
from kvkit.policies.knobs import build_slot_cost, floor_warning, protected_share, static_prompt
from kvkit.policies.protect_heads import ProtectHeads, check_protect, evicting_parts, split_or_plain
from kvkit.registry import register
from kvkit.stores import LayerInfo
from kvkit.stores.reconstruct import forward_to_repeat, reconstruct
from kvkit.stores.scored import POOL_WINDOWS
from kvkit.stores.static import static_store

PROTECT_SCORES = ("window", "reconstruct")
PROTECT_SCOPES = ("chunk", "context")


@register("chelsea")
@dataclass(frozen=True)
class Chelsea(ProtectHeads, Policy):
    """Chelsea chunked KV clustering.

    Parameters
    ----------
    ratio : float
        Fraction of the slots a merged chunk keeps, in (0, 1] (0.2: the paper's 80% KV reduction;
        1.0 merges nothing).
    chunk_size : int or None
        Tokens per chunk (the paper clusters within fixed-size chunks and gives no size). None: the model's
        calibrated size (``kvkit calibrate chelsea``), else 64 (kvkit's default: a few sentences).
    sink : int
        First tokens of each row never merged (attention sinks; kvkit, not the paper).
    window : int
        Most recent tokens never merged (kvkit, not the paper).
    merge_interval : int
        New tokens between two merges during decoding (kvkit; one chunk).
    size_bias : bool
        Add ``log(cluster size)`` to merged keys' scores (ToMe proportional attention; kvkit's
        option).
    protect : float or None
        Fraction of each chunk kept exact by observation-window attention (kvkit, beyond the paper;
        0 = the paper's matching). Must stay below ``ratio``. None (default): ``PROTECT_SHARE * ratio`` (that share of
        the slots a chunk keeps, at most all but one), or 0 with ``calibrated=False`` (the paper's whole setting).
    protect_kernel : int or None
        Pooling width of the protection score along the tokens (odd). None: calibrated, else 7 (SnapKV's kernel).
    protect_pooling : str or None
        "max" or "avg" pooling of the protection score. None: calibrated, else "max".
    protect_window : str or None
        "centered" (SnapKV's pooling: kernel // 2 tokens on each side) or "trailing" (kvkit: the token and the
        kernel - 1 before it, so the tokens right after an attended one are protected too: a whole number or UUID).
        None: calibrated, else "centered".
    protect_score : str
        What ranks the slots kept exact: "window" (default: the last ``window`` queries' attention, SnapKV's score;
        with the question in the prompt, the question's) or "reconstruct" (kvkit, question-agnostic: KVzip's context
        reconstruction score, one more pass over the tokens after each multi-token forward; not pooled).
    recon_chunk : int
        Tokens per reconstruction forward with ``protect_score="reconstruct"`` (KVzip's chunking, kvkit's 512).
    protect_scope : str
        Where the protected slots are ranked: "chunk" (default: the ``protect`` share of every chunk) or "context"
        (kvkit: per KV head over all the chunks merged together, ``protect`` x their tokens, at most all but
        ``ratio - protect`` of one chunk: a chunk with more high-scored tokens keeps more exact, one with fewer keeps
        fewer, as KVzip ranks a head's tokens over the whole context). Every chunk still ends with ``ceil(ratio * chunk)`` slots on average
        (a KV head holds the same total); each merges its unprotected tokens into ``ceil(ratio * chunk) -
        ceil(protect * chunk)`` centroids.
    calibrated : bool
        True (default): with ``protect`` > 0, ``chunk_size`` and the ``protect_*`` options left at None take the
        model's calibration (``kvkit calibrate chelsea``, :mod:`kvkit.calibration`: chosen on needles with the
        question in the prefill), else the fallbacks above. False: the fallbacks, and ``protect`` left at None is 0
        (the paper's matching), so ``calibrated=False`` alone is the paper's setting.
    protect_heads : float
        Fraction of the KV heads kept whole, unmerged: the ones the model's DuoAttention pattern ranks highest
        (kvkit, :mod:`kvkit.policies.protect_heads`; not the same as ``protect``, which keeps tokens of a chunk
        exact); the other heads merge as above. None (default), where a pattern ships for the model: with
        ``compression_ratio`` the share that leaves each evicted head a sixth of the context (0.4 at 0.5, 0.1 at
        0.75; :func:`~kvkit.policies.protect_heads.default_protect`), with a ``budget`` 0.2; else 0 (warned once).
        0: the paper, every head merged.
    protect_pattern : str, path, values or None
        The pattern ``protect_heads`` ranks by (as duo's ``pattern``); None: the one shipped for the model.
    """

    ratio: float = 0.2  # Chelsea: up to 80% KV memory reduction
    chunk_size: int | None = None  # None: calibrated, else CHUNK (kvkit: a chunk the size of a few sentences)
    sink: int = 4  # StreamingLLM's 4 sink tokens, kept exact
    window: int = 32  # recent tokens kept exact
    merge_interval: int = 64  # one chunk of new tokens between merges
    size_bias: bool = True  # kvkit's default
    protect: float | None = None  # kvkit: None = PROTECT_SHARE * ratio; 0 = the paper's matching over every slot
    protect_kernel: int | None = None  # None: calibrated, else SnapKV's paper kernel 7 (max-pooled)
    protect_pooling: str | None = None  # None: calibrated, else "max"
    protect_window: str | None = None  # None: calibrated, else SnapKV's centered window ("trailing": kvkit)
    protect_score: str = "window"  # kvkit: "window" (observation window) or "reconstruct" (KVzip's score)
    recon_chunk: int = 512  # kvkit: reconstruction chunk (KVzip's chunked repeat)
    protect_scope: str = "chunk"  # kvkit: "chunk" (P per chunk) or "context" (P x chunks per KV head, KVzip-like)
    calibrated: bool = True  # kvkit: the model's calibrated chunk_size / protect_*; False = the fallbacks
    protect_heads: float | None = None  # kvkit: default_protect(ratio) if a pattern ships (0 = paper)
    protect_pattern: object = None  # kvkit: the pattern `protect_heads` ranks by; None = the model's shipped one

    CHUNK: ClassVar[int] = 64  # fallback chunk_size
    PROTECT_POOL: ClassVar[tuple] = (7, "max", "centered")  # fallback protect_kernel / pooling / window
    #: protect=None: the share of a chunk's kept slots protected (kvkit's default, results/ruler/README.md)
    PROTECT_SHARE: ClassVar[float] = 0.8
    RECON_OVERLAP: ClassVar[int] = 8  # KVzip's prev_postfix_size: tokens of the previous chunk before each repeat

    static_capable: ClassVar[bool] = True
    description = "Chelsea: chunked soft-matching merge of similar keys/values into sized centroids (2506.11418)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = (
        "chunk_size", "protect_kernel", "protect_pooling", "protect_window")
    ratio_knobs: ClassVar[tuple[str, ...]] = ("ratio",)
    #: the paper: its matching over every slot (no protection), no size bias, every head merged
    paper: ClassVar[dict] = dict(calibrated=False, size_bias=False, protect_heads=0.0)
    covering_options: ClassVar[dict | None] = dict(ratio=1.0)

    def __post_init__(self):
        super().__post_init__()
        check_fraction("chelsea", "ratio", self.ratio)
        check_positive_int("chelsea", "chunk_size", self.chunk_size, allow_none=True)
        check_positive_int("chelsea", "merge_interval", self.merge_interval)
        for name in ("sink", "window"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"chelsea: {name} must be an integer >= 0, got {val!r}")
        if not isinstance(self.size_bias, bool):
            raise ValueError(f"chelsea: size_bias must be True or False, got {self.size_bias!r}")
        pr = self.protect
        if pr is not None and (isinstance(pr, bool) or not isinstance(pr, (int, float)) or not 0 <= pr < 1):
            raise ValueError(f"chelsea: protect must be a fraction in [0, 1) (0: the paper's matching), got {pr!r}")
        check_odd_kernel("chelsea", "protect_kernel", self.protect_kernel)
        check_choice("chelsea", "protect_pooling", self.protect_pooling, ("max", "avg"))
        check_choice("chelsea", "protect_window", self.protect_window, POOL_WINDOWS)
        check_choice("chelsea", "protect_score", self.protect_score, PROTECT_SCORES, allow_none=False)
        check_positive_int("chelsea", "recon_chunk", self.recon_chunk)
        check_choice("chelsea", "protect_scope", self.protect_scope, PROTECT_SCOPES, allow_none=False)
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"chelsea: calibrated must be true or false, got {self.calibrated!r}")
        check_protect(self)
        # with chunk_size None the chunk is the model's calibration (or the fallback): checked at patch time
        # (``settings`` fills it in), so a protect that fits the calibrated chunk is not refused here
        if (self.chunk_size is not None and self.protect is not None and self.protect
                and self.protected_per_chunk >= self.kept_per_chunk):
            raise ValueError(
                f"chelsea: protect ({self.protect}) keeps {self.protected_per_chunk} of each {self.chunk}-token "
                f"chunk exact, but the chunk keeps only {self.kept_per_chunk} slots (ratio {self.ratio}): "
                "use protect < ratio"
            )

    @property
    def chunk(self) -> int:
        """The chunk size in effect (the fallback when ``chunk_size`` is None and no calibration filled it)."""
        return self.chunk_size if self.chunk_size is not None else self.CHUNK

    @property
    def kept_per_chunk(self) -> int:
        return max(1, math.ceil(self.ratio * self.chunk - 1e-9))

    @property
    def protected_per_chunk(self) -> int:
        """Slots of a merged chunk kept exact: ``ceil(protect * chunk)``; with ``protect`` None ``PROTECT_SHARE`` of the
        kept slots (at most all but one), none with ``calibrated=False`` or ``ratio`` 1 (nothing merges)."""
        if self.protect is not None:
            return math.ceil(self.protect * self.chunk - 1e-9) if self.protect else 0
        if not self.calibrated or self.ratio >= 1:
            return 0
        return min(math.ceil(self.PROTECT_SHARE * self.ratio * self.chunk - 1e-9), self.kept_per_chunk - 1)

    def settings(self, config, context: int | None = None, share: float = 0.0, cost: float = 1.0) -> Chelsea:
        """This policy for the model of ``config``: calibrated options filled in (when ``calibrated``, ``protect`` > 0
        -- the calibration is of the protection -- and none of them was given), then the fallbacks; every field
        concrete. With ``compression_ratio``, ``ratio`` is resolved for a ``context``-token cache whose protected
        heads (``share`` of them) keep everything, each slot ``cost`` times a token's K/V bytes (:meth:`ratio_for`; the
        target share itself without a context)."""

        p = resolve(self, config)
        if p.compression_ratio is not None:
            p = dataclasses.replace(p, ratio=self.ratio_for(p.chunk, context, share, cost),
                                    compression_ratio=None)
        k, pool, win = self.PROTECT_POOL
        return dataclasses.replace(
            p, chunk_size=p.chunk, protect=p.protect if p.protect is not None else p.protected_per_chunk / p.chunk,
            protect_kernel=p.protect_kernel if p.protect_kernel is not None else k,
            protect_pooling=p.protect_pooling or pool, protect_window=p.protect_window or win)

    def ratio_for(self, chunk: int, context: int | None, share: float, cost: float = 1.0) -> float:
        """``ratio`` that keeps ``1 - compression_ratio`` of a ``context``-token cache: the protected heads keep
        everything, the sinks, the window and a partial chunk stay exact, the ``M`` tokens of complete chunks keep
        ``K`` slots per ``chunk``, a slot ``cost`` times a token's K/V bytes (its position and cluster size):
        ``share + (1 - share) cost (context - M + K M / chunk) / context = 1 - r``."""
        kept = ((1.0 - self.compression_ratio) - share) / (1.0 - share)
        if not context:
            return min(1.0, max(kept, 1.0 / chunk))
        M = max(0, (context - self.sink - self.window) // chunk) * chunk
        if M == 0:
            floor_warning(self.name, self.compression_ratio, 1.0, f"a {context}-token context is all sinks, window "
                          f"and a partial {chunk}-token chunk, which stay exact")
            return 1.0
        K = round((kept * context / cost - (context - M)) * chunk / M)
        if K < 1:
            reads = share + (1 - share) * cost * (context - M + M / chunk) / context
            floor_warning(self.name, self.compression_ratio, min(reads, 1.0),
                          f"a {context}-token context needs fewer than the one slot per {chunk}-token chunk each "
                          f"evicting head always keeps (besides its sinks and window)")
        return min(chunk, max(K, 1)) / chunk

    def uses_calibration(self) -> bool:
        # the calibration is of the protection: the paper's matching takes none. protect=None: the calibrated chunk
        # decides how many slots are protected, so only the share is known here
        return bool(self.protect) if self.protect is not None else self.ratio < 1

    def validate(self, config) -> None:
        self.settings(config)  # a calibration that does not combine with the options fails at patch time
        self.protection(config)

    def reconstructs(self) -> bool:
        """The protection is scored by a reconstruction pass (``protect_score="reconstruct"`` with slots to protect)."""
        return self.protect_score == "reconstruct" and self.ratio < 1 and (
            self.protect is None and self.calibrated or bool(self.protect))

    def new_layer(self, info: LayerInfo):
        prompt = static_prompt(self, info)  # a static store: the ratio for the declared prompt, now
        cls = static_store(ChelseaStore) if info.static else ChelseaStore
        share = protected_share(info.shared, info.config)
        p = self.settings(info.config, prompt, share, build_slot_cost(info, extra_bytes=8))
        at = None
        if self.compression_ratio is not None:  # the ratio for the context length, at each prefill
            at = lambda S, cost: self.settings(info.config, S, share, cost)  # noqa: E731
        return split_or_plain(info, lambda n: cls(info, p, num_heads=n, settings_at=at), info.shared)

    # ---- the reconstruction pass (kvkit's forward hook on the patched base model) --------------------------
    @torch.no_grad()
    def after_forward(self, base_model, cache, input_ids, attention_mask) -> None:
        """``protect_score="reconstruct"``: after each multi-token forward (not a verification, not a reconstruction
        forward itself) its tokens are repeated (:func:`kvkit.stores.reconstruct.reconstruct`), every layer takes
        the scores as its protection score and merges."""
        if torch.compiler.is_compiling():
            return  # a compiled step (static cache) decodes one token: nothing to repeat
        layers, roll = evicting_parts(cache, ChelseaStore)  # the stores a repeat scores, the cache layers it rolls back
        if (cache.scoring_pass or not layers or not layers[0].by_reconstruction
                or any(layer.verifying for layer in layers)):
            return
        T, mask = forward_to_repeat(layers, input_ids, attention_mask, "chelsea with protect_score='reconstruct'",
                                    ", or use protect_score='window'")
        if T == 0:
            return
        if mask is None:
            mask = torch.ones(input_ids.shape[0], layers[0].seen, dtype=torch.long, device=input_ids.device)
        reconstruct(base_model, cache, layers, input_ids[:, -T:], mask[:, -T:], mask, self.recon_chunk,
                    self.RECON_OVERLAP, roll=roll)
        for layer in layers:
            layer.take_scores()
            layer.compress()
            layer.committed = layer.seen
