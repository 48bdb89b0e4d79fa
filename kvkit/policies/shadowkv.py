"""``shadowkv``: ShadowKV (Sun et al., arXiv:2410.21465) -- low-rank pre-RoPE keys + offloaded values.

At the end of the prefill of a long prompt (more than ``min_prompt`` tokens; shorter prompts run
exactly as ``full``), each layer splits the prompt into chunks of ``chunk_size`` tokens and keeps

* **keys** as a truncated SVD of the prompt's *pre-RoPE* keys, heads concatenated (``[S, Hkv*D]``,
  fp32 SVD per batch row): ``U[:, :r]`` ``[B, S, r]`` shared by the heads and ``S*V^T`` split per KV
  head ``[B, Hkv, r, D]``;
* **landmarks**: the mean post-RoPE key of every chunk, per KV head ``[B, Hkv, C, D]``;
* **outliers**: per KV head the ``outliers`` chunks whose keys are least similar to their chunk mean
  (lowest min-cosine-similarity) stay exact on the device (keys and values) and leave the landmark set;
* **local window**: the last ``local_chunks`` chunks plus ``S mod chunk_size`` tokens, exact; every
  generated token is appended exactly after it (so ``crop`` of generated tokens is exact);
* **values** of the chunks go to an offload store: CPU pinned memory when the model is on CUDA; on
  CPU-only runs a separate tensor. ``nbytes()`` reports only device-resident bytes (U, S*V^T,
  landmarks, outlier/local/generated K/V, index metadata); ``offloaded_nbytes()`` the value store.

Decode (per layer): :func:`kvkit.kernels.chunk_scores` -- per KV head and query token,
``softmax(q . landmark / sqrt(D))`` in fp32, max over the query heads of the group -- and
:func:`kvkit.kernels.topk_indices` pick the top ``budget // chunk_size`` chunks; the selected chunks' keys are
rebuilt (``U[rows] @ (S*V^T)[head]``, RoPE at the original positions) and attended with their values together
with the exact outliers and the local + generated slots, one softmax over the union:

* CUDA: :func:`kvkit.kernels.lowrank_decode` (Triton, fused) for the chunks, :func:`kvkit.stores.attend_slots`
  for the exact slots, combined by their log-sum-exp (:func:`kvkit.kernels.merge_attn`);
* CPU, one token (decode): :func:`kvkit.kernels.lowrank_token_decode` (the C kernel), one call per layer that rebuilds
  each key in registers and never stores it, exact slots in the same softmax (torch fallback without a C
  compiler: half-width RoPE tables, LSE merge of the parts once they are large);
* several query tokens in one forward (speculative verification, chunked prefill): the general path, each
  token picking its own chunks (``lowrank_decode``'s torch reference with a RoPE table shared by the cache's
  layers), so a T-token forward equals T single-token forwards.

Why inverse RoPE instead of a hook: the cache only ever receives post-RoPE keys, and for the
rotate_half convention of transformers ``k = a*R(theta) k_pre`` (``a`` = the rope attention scaling,
1 for plain RoPE), so ``k_pre = (k*cos - rotate_half(k)*sin) / (cos^2 + sin^2)`` recovers the pre-RoPE
key exactly from the model's own ``(cos, sin)`` (``info.rope`` at the positions the model used, read
from the ``position_ids`` the attention function receives). No modeling code is hooked or copied and
any RoPE variant the model's rotary module implements (linear, dynamic, YaRN, llama3) is inverted.

Rank: the paper uses 160 for Llama-3-8B (``Hkv*D = 1024``); ``rank=None`` keeps that fraction,
``round(160 / 1024 * Hkv*D)`` (30 for SmolLM2-135M, ``Hkv*D = 192``). The rank is a per-model knob:
the relative error of the rebuilt keys falls as the rank grows (``rank = Hkv*D`` is exact) and how fast
depends on the model's key spectrum, so a small model may need a larger fraction than the paper's;
one more rank holds ``S`` more U entries per layer and batch row and reads one more per selected token
and KV head. ``outliers=None`` scales the paper's 48 chunks at budget 2048 with the budget.

Batches: rows share one stored length (left padding). Chunks are laid out from each row's first real
token, so padding never enters a chunk, the SVD (padding rows are zero, which leaves the singular
vectors of the real rows unchanged) or a landmark, and a padded row compresses as it would alone.
Whether to compress is decided once per batch on the stored prompt length.

Chunked prefill (``kvkit.prefill``): the prompt is compressed at the first single-token decode step
(or at the end of the first forward when that forward alone exceeds ``min_prompt``; later chunks of
such a prompt then stay exact). Not done (yet): reusing the value chunks fetched at the previous step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvkit.kernels import chunk_scores, lowrank_decode, lowrank_token_decode, merge_attn, topk_indices
from kvkit.kernels.reference import chunks_to_tokens
from kvkit.model_info import apply_rope, inverse_rope  # noqa: F401  (apply_rope: re-exported for tests)
from kvkit.policies.base import Policy, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore, attend_slots, hf_sdpa
from kvkit.stores import tensor_bytes as _tensor_bytes

PAPER_RANK, PAPER_WIDTH = 160, 1024  # ShadowKV: rank 160 for Llama-3-8B (8 KV heads x 128)
PAPER_OUTLIERS, PAPER_BUDGET = 48, 2048  # ShadowKV: 48 outlier chunks at a 2048-token budget


@register("shadowkv")
@dataclass(frozen=True)
class ShadowKV(Policy):
    """ShadowKV: low-rank pre-RoPE keys + chunk landmarks on device, values offloaded, sparse decode.

    Parameters
    ----------
    budget : int
        Tokens selected per KV head at each decode step (``budget // chunk_size`` chunks); 2048 in the paper.
    rank : int or None
        SVD rank of the pre-RoPE keys (per model: higher = smaller key error, more bytes); None: the model's
        calibrated rank when it has one (``kvkit calibrate shadowkv``: smallest rank whose rebuilt keys stay
        within a relative error bound in every layer; shipped for the bundled models), else
        ``round(160 / 1024 * Hkv*D)`` (paper: 160 at ``Hkv*D = 1024``).
    chunk_size : int
        Tokens per chunk / landmark; 8 in the paper.
    outliers : int or None
        Outlier chunks per KV head kept exact; None: ``round(48 * budget / 2048)`` (paper: 48 at 2048).
    local_chunks : int
        Last chunks of the prompt kept exact (paper: 4 chunks = 32 tokens), plus ``S mod chunk_size``.
    min_prompt : int
        Only prompts longer than this are compressed (paper: 4096); shorter ones run as ``full``.
    calibrated : bool
        True (default): ``rank=None`` takes the model's calibrated rank if one is found from its config
        (:mod:`kvkit.calibrate.store`). False: the paper's rank ``round(160 / 1024 * Hkv*D)``.
    """

    budget: int = PAPER_BUDGET  # ShadowKV sparse budget, 2048 tokens
    rank: int | None = None  # ShadowKV rank 160 at Hkv*D = 1024; None scales it to the model
    chunk_size: int = 8  # ShadowKV chunk size
    outliers: int | None = None  # ShadowKV: 48 outlier chunks at budget 2048; None scales with budget
    local_chunks: int = 4  # ShadowKV local window: 4 chunks (32 tokens)
    min_prompt: int = 4096  # ShadowKV applies to long contexts; shorter prompts behave as full
    calibrated: bool = True  # kvkit: rank=None uses the model's calibrated rank; False = paper's 160/1024 scaling

    description = "ShadowKV: low-rank pre-RoPE keys + landmarks on device, values offloaded, top-k chunks (2410.21465)"
    saves = "memory+reads"
    calibrated_options: ClassVar[tuple[str, ...]] = ("rank",)
    test_options: ClassVar[dict] = dict(budget=16, min_prompt=16)
    covering_options: ClassVar[dict | None] = dict(min_prompt=100_000)

    def __post_init__(self):
        check_positive_int("shadowkv", "budget", self.budget)
        check_positive_int("shadowkv", "chunk_size", self.chunk_size)
        check_positive_int("shadowkv", "rank", self.rank, allow_none=True)
        for name in ("outliers", "local_chunks", "min_prompt"):
            v = getattr(self, name)
            if v is None and name == "outliers":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"shadowkv: {name} must be an integer >= 0, got {v!r}")
        if self.budget < self.chunk_size:
            raise ValueError(
                f"shadowkv: budget ({self.budget}) must be at least chunk_size ({self.chunk_size}) so that one "
                "chunk can be selected"
            )

    # ---- derived settings --------------------------------------------------------------------
    def rank_for(self, width: int) -> int:
        """SVD rank for a layer whose keys are ``width = Hkv*D`` wide (raises if the rank cannot fit)."""
        if self.rank is None:
            return max(1, round(PAPER_RANK / PAPER_WIDTH * width))
        if self.rank > width:
            raise ValueError(
                f"shadowkv: rank={self.rank} is larger than the key width num_key_value_heads*head_dim = {width}; "
                f"use rank <= {width} (or rank=None for {max(1, round(PAPER_RANK / PAPER_WIDTH * width))})"
            )
        return self.rank

    def num_outliers(self) -> int:
        if self.outliers is not None:
            return self.outliers
        return round(PAPER_OUTLIERS * self.budget / PAPER_BUDGET)

    def validate(self, config) -> None:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        from kvkit.calibrate.store import resolve

        resolve(self, config).rank_for(kv * head_dim)

    def new_shared(self, infos):
        return ShadowKVShared()

    def new_layer(self, info: LayerInfo):
        from kvkit.calibrate.store import resolve

        rank = resolve(self, info.config).rank_for(info.num_kv_heads * info.head_dim)
        return ShadowKVStore(info, self, rank)


@dataclass
class ShadowKVShared:
    """What one cache's ShadowKV layers share: the RoPE table of the torch decode path (rows = positions,
    ``(cos, sin)`` each ``[P, Dr]`` fp32 from the model's own rotary module; it depends on the model, not on
    the batch, and is not KV, so ``nbytes`` does not count it)."""

    tables: dict = field(default_factory=dict)  # device -> (cos, sin)

    def rope_table(self, rope, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for positions ``0 .. >= n-1`` on ``device`` (computed once, grown when needed)."""
        t = self.tables.get(device)
        if t is None or t[0].shape[0] < n:
            cos, sin = rope(torch.arange(n, device=device)[None])
            t = (cos[0].to(device, torch.float32).contiguous(), sin[0].to(device, torch.float32).contiguous())
            self.tables[device] = t
        return t

    def rope_half(self, rope, n: int, device):
        """The first ``Dr/2`` columns of :meth:`rope_table`'s ``(cos, sin)`` when the table has the rotate_half
        layout (each row's two halves equal, as transformers' rotary modules build it), else None."""
        cos, sin = self.rope_table(rope, n, device)
        key = (device, "half", cos.shape[0])
        if key not in self.tables:
            h = cos.shape[-1] // 2
            ok = torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])
            self.tables[key] = (cos[:, :h].contiguous(), sin[:, :h].contiguous()) if ok else None
        return self.tables[key]


class ShadowKVStore(SlotStore):
    """One layer of ShadowKV. Before compression it is a plain exact store (attention is transformers'
    own sdpa, as ``full``); after it, ``keys/values/pos`` hold only the exact local window + generated
    tokens and the compressed prompt lives in the tensors listed in ``_batch_tensors``."""

    concat_below: ClassVar[int] = 1 << 17  # read K elements under which _decode_one_cpu concatenates the parts
    fused_cpu_step: ClassVar[bool] = True  # False: every step through the general path (tests compare the two)

    _batch_tensors = SlotStore._batch_tensors + (
        "rpos", "U", "SV", "landmarks", "lm_ids", "n_chunks", "out_k", "out_v", "out_pos", "rope_base",
        "rope_pos", "v_off",
    )

    def __init__(self, info: LayerInfo, policy: ShadowKV, rank: int):
        super().__init__(info)
        self.budget, self.chunk = policy.budget, policy.chunk_size
        self.rank, self.n_out = rank, policy.num_outliers()
        self.local_chunks, self.min_prompt = policy.local_chunks, policy.min_prompt
        self._clear()

    def _clear(self) -> None:
        self._rope_params = None  # (device, inv_freq, attention_scaling) of the rotary module
        self._rope_hi = 0  # 1 + the largest RoPE position of a chunk token
        self._lm_all_valid = False  # every landmark belongs to a real chunk (no row has fewer chunks)
        self.compressed = False
        self.decoding = False
        self.rpos = None  # [B, n] int32 RoPE positions of the held tokens (only before compression)
        self.U = self.SV = self.landmarks = self.lm_ids = self.n_chunks = None
        self.out_k = self.out_v = self.out_pos = self.rope_base = self.rope_pos = self.v_off = None
        self._fused = None  # constants of _decode_one_cpu, tied to the landmarks tensor they were made for

    def reset(self) -> None:
        super().reset()
        self._clear()

    # ---- transformers Cache API -------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        if T == 1 and not self.decoding:
            # first single-token step: everything held so far is the prompt (covers chunked prefill)
            self.decoding = True
            if not self.compressed and self.keys is not None and self.seen > self.min_prompt:
                self.compress()
                self.committed = self.seen
        self.append(key_states, value_states)
        return key_states, value_states

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        if self.rpos is not None:
            self.rpos = self.rpos[:, :-n]

    def nbytes(self) -> int:
        return super().nbytes() + _tensor_bytes(
            self.rpos, self.U, self.SV, self.landmarks, self.lm_ids, self.n_chunks, self.out_k, self.out_v,
            self.out_pos, self.rope_base, self.rope_pos, self.first_pos,
        )

    def offloaded_nbytes(self) -> int:
        return _tensor_bytes(self.v_off)

    def read_nbytes(self) -> int:
        """Bytes one decode step reads once compressed: all landmarks, the selected chunks' rows of U
        (gathered per KV head) and SV, their values from the offload store, outliers and the exact
        local/generated slots. Before compression: everything held, as full attention."""
        if not self.compressed:
            return self.nbytes()
        B, H = self.keys.shape[:2]
        D = self.keys.shape[-1]
        k_tok = min(self.budget // self.chunk, self.lm_ids.shape[-1]) * self.chunk
        gathered = B * H * k_tok * (self.U.shape[-1] * self.U.element_size() + D * self.v_off.element_size())
        return gathered + _tensor_bytes(self.landmarks, self.lm_ids, self.SV, self.out_k, self.out_v, self.out_pos,
                                        self.keys, self.values, self.pos)

    def num_slots(self) -> int:
        n = super().num_slots()
        if self.compressed:
            n += min(self.budget // self.chunk, self.lm_ids.shape[-1]) * self.chunk + self.out_k.shape[-2]
        return n

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]
        self.mark_padding(attention_mask, T)
        if not self.compressed:
            self._record_positions(kwargs.get("position_ids"), T)
            # exact, and bit-identical to `full`: the held tokens are all tokens, in position order
            out = hf_sdpa(module, query, self.keys, self.values, attention_mask, scaling, dropout, **kwargs)
            if self.seen == T and self.seen > self.min_prompt:
                self.compress()
                self.committed = self.seen
            return out
        qpos = torch.arange(self.seen - T, self.seen, device=query.device, dtype=torch.int32)
        return self.decode(query, qpos, scaling)

    def _record_positions(self, position_ids, T: int) -> None:
        B = self.keys.shape[0]
        if position_ids is None:
            p = torch.arange(self.seen - T, self.seen, device=self.keys.device)[None]
        else:
            p = position_ids[..., -T:].to(self.keys.device)
        p = p.to(torch.int32).expand(B, T)
        self.rpos = p.contiguous() if self.rpos is None else torch.cat([self.rpos, p], dim=1)

    # ---- compression -------------------------------------------------------------------------
    @torch.no_grad()
    def compress(self) -> None:
        """Factorize the held prompt (all held tokens) into the ShadowKV layout."""
        if self.info.rope is None:
            raise ValueError("shadowkv needs the model's rotary embedding (info.rope) to invert RoPE; none was found")
        keys, values, dev = self.keys, self.values, self.keys.device
        B, H, S, D = keys.shape
        c = self.chunk
        first = self.first_pos.to(dev).long()  # [B]
        L = S - first  # real tokens per row
        n_chunks = (L // c - self.local_chunks).clamp(min=0)  # [B]
        C = int(n_chunks.max())
        if C == 0:  # too short to have chunks: stay exact
            return
        N = C * c
        # token index (storage) of chunk token j of row b: first_b + j; chunks start at the first real token
        j = torch.arange(N, device=dev)
        tok = (first[:, None] + j[None]).clamp(max=S - 1)  # [B, N]
        tok_valid = j[None] < (n_chunks * c)[:, None]  # [B, N]
        gidx = tok[:, None, :, None].expand(B, H, N, D)
        kc = keys.gather(2, gidx)  # [B, H, N, D] post-RoPE
        vc = values.gather(2, gidx)
        rp = self.rpos.gather(1, tok)  # [B, N] RoPE positions

        # pre-RoPE keys, exact inverse rotation; padding/invalid rows are zero (no effect on the SVD)
        cos, sin = self.info.rope(rp)
        cos, sin = cos.to(dev, torch.float32)[:, None], sin.to(dev, torch.float32)[:, None]
        k_pre = inverse_rope(kc.float(), cos, sin) * tok_valid[:, None, :, None]
        X = k_pre.permute(0, 2, 1, 3).reshape(B, N, H * D)
        U, Sv, Vh = torch.linalg.svd(X, full_matrices=False)  # fp32
        r = min(self.rank, Sv.shape[-1])
        self.U = U[..., :r].to(keys.dtype).contiguous()  # [B, N, r]
        SV = (Sv[..., :r, None] * Vh[:, :r]).view(B, r, H, D).permute(0, 2, 1, 3)
        self.SV = SV.to(keys.dtype).contiguous()  # [B, H, r, D]

        # RoPE positions of the chunk tokens: one offset per row when contiguous (the usual case)
        base = rp[:, :1]
        if bool(((rp == base + j[None].to(rp.dtype)) | ~tok_valid).all()):
            self.rope_base, self.rope_pos = base.contiguous(), None
            self._rope_hi = int(base.max()) + N
        else:
            self.rope_base, self.rope_pos = None, rp.contiguous()
            self._rope_hi = int(rp.max()) + 1
        if self.info.rope is not None:  # the table and its layout check now (a compression event), not at decode
            self.info.shared.rope_half(self.info.rope, self._rope_hi, dev)

        # landmarks and outliers (post-RoPE keys, per KV head)
        k5 = kc.float().view(B, H, C, c, D)
        mean = k5.mean(dim=3)  # [B, H, C, D]
        chunk_valid = torch.arange(C, device=dev)[None] < n_chunks[:, None]  # [B, C]
        cos_sim = torch.nn.functional.cosine_similarity(k5, mean[:, :, :, None], dim=-1).amin(-1)  # [B, H, C]
        cos_sim = cos_sim.masked_fill(~chunk_valid[:, None], float("inf"))
        n_out = min(self.n_out, C)
        out_ids = (-cos_sim).topk(n_out, dim=-1).indices.sort(dim=-1).values  # [B, H, n_out]
        is_out = torch.zeros(B, H, C, dtype=torch.bool, device=dev)
        is_out.scatter_(-1, out_ids, True)
        # non-outlier chunks first, in chunk order (stable sort)
        self.lm_ids = torch.sort(is_out.to(torch.int8), dim=-1, stable=True).indices[..., : C - n_out].to(torch.int32)
        self.landmarks = mean.gather(2, self.lm_ids.long()[..., None].expand(-1, -1, -1, D)).to(keys.dtype)
        self.n_chunks = n_chunks.to(torch.int32)
        self._lm_all_valid = bool((self.lm_ids < self.n_chunks.view(B, 1, 1)).all())
        out_tok = (out_ids[..., None] * c + torch.arange(c, device=dev)).flatten(2)  # [B, H, n_out*c] in [0, N)
        og = out_tok[..., None].expand(-1, -1, -1, D)
        self.out_k = kc.gather(2, og).contiguous()
        self.out_v = vc.gather(2, og).contiguous()
        out_valid = chunk_valid.gather(1, out_ids.flatten(1)).view(B, H, n_out)
        out_valid = out_valid[..., None].expand(-1, -1, -1, c).flatten(2)
        out_spos = tok[:, None, :].expand(B, H, N).gather(2, out_tok)
        self.out_pos = torch.where(out_valid, out_spos, -1).to(torch.int32)  # storage positions, -1 = none

        # values: offload store (pinned CPU memory on CUDA, a separate tensor on CPU)
        if vc.is_cuda:
            self.v_off = vc.to("cpu").pin_memory()
        else:
            self.v_off = vc.clone()

        # exact local window: the last Tt stored tokens; slots that belong to a row's chunks are masked
        local_start = first + n_chunks * c  # [B] first local token of each row
        Tt = int((S - local_start).max())
        pos = self.pos[..., S - Tt :]
        spos = torch.arange(S - Tt, S, device=dev)
        pos = torch.where(spos[None, None] >= local_start[:, None, None], pos, torch.full_like(pos, -1))
        self.keys = keys[..., S - Tt :, :].contiguous()
        self.values = values[..., S - Tt :, :].contiguous()
        self.pos = pos.contiguous()
        self.rpos = None
        self.compressed = True

    # ---- decode ------------------------------------------------------------------------------
    def _select(self, query: torch.Tensor) -> torch.Tensor:
        """Top chunks per (row, KV head, query token): chunk ids into U's rows ``[B, H, T, k]`` (-1 = none),
        increasing."""
        B, Hq, T, D = query.shape
        H, Cl = self.lm_ids.shape[1], self.lm_ids.shape[-1]
        k = min(self.budget // self.chunk, Cl)
        lm_valid = None if self._lm_all_valid else self.lm_ids < self.n_chunks.view(B, 1, 1)  # [B, H, Cl]
        s = chunk_scores(query, self.landmarks, softmax=True, chunk_mask=lm_valid, per_token=True)  # [B, H, T, Cl]
        if lm_valid is not None:
            s = s.masked_fill(~lm_valid[:, :, None], float("-inf"))  # softmax gave them 0: never select them
        sel = topk_indices(s, k)  # landmark slots, -1 = none
        ids = self.lm_ids[:, :, None].expand(B, H, T, Cl).gather(-1, sel.clamp(min=0))
        return torch.where(sel >= 0, ids, -1)

    def _lowrank(self, query: torch.Tensor, ids: torch.Tensor, scaling: float):
        """``lowrank_decode`` over the chunks ``ids``: (out ``[B, Hq, T, D]``, lse ``[B, Hq, T]``)."""
        B, dev = query.shape[0], query.device
        kw = dict(position_offset=self.rope_base.view(B)) if self.rope_base is not None else dict(positions=self.rope_pos)
        if self._rope_params is None or self._rope_params[0] != dev:
            params = getattr(self.info.rope, "params", None)
            params = params() if params is not None else None
            inv, a = (params[0].to(dev, torch.float32), params[1]) if params is not None else (None, 1.0)
            self._rope_params = (dev, inv, a)
        _, inv, a = self._rope_params
        # built only where lowrank_decode takes its torch path (the kernels package picks)
        table = lambda: self.info.shared.rope_table(self.info.rope, self._rope_hi, dev)  # noqa: E731
        v, gathered = self.v_off, False
        if v.device != dev:  # offloaded values: fetch the selected chunks' rows (in list order)
            tok = chunks_to_tokens(ids.to(v.device), self.chunk, self.U.shape[1]).clamp(min=0)
            Bh = torch.arange(B, device=v.device).view(B, 1, 1, 1)
            Hh = torch.arange(v.shape[1], device=v.device).view(1, -1, 1, 1)
            v = v[Bh, Hh, tok].flatten(2, 3).to(dev, non_blocking=True)
            gathered = True
        return lowrank_decode(query, self.U, self.SV, v, ids, self.chunk, inv, attention_scaling=a,
                              v_gathered=gathered, scale=scaling, return_lse=True, rope_table=table, **kw)

    def _decode_one_cpu(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode token on the CPU. Same selection as :meth:`_select` (chunk_scores' math: softmax over the
        chunks per query head, max over the group's heads; unsorted, as the order of the read slots does not
        matter to a softmax) and the same keys as :func:`lowrank_decode` (``U[rows] @ (S*V^T)[head]``, RoPE from
        the shared table, fp32). The selected chunks are attended by the C kernel behind
        :func:`kvkit.kernels.lowrank_token_decode` (keys rebuilt in registers, never stored) when it is available, else
        rebuilt in torch with half-width RoPE tables; the exact outliers and local + generated slots through
        :func:`attend_slots`. Small parts go into one attention over their concatenation, large ones are merged
        by log-sum-exp (which copies nothing). Returns ``[B, 1, Hq, D]``."""
        B = query.shape[0]
        H, N, r = self.SV.shape[1], self.U.shape[1], self.U.shape[2]
        D = self.SV.shape[-1]
        ks, vs, ps, done = [], [], [], []  # parts to attend (keys, values, slot positions); parts attended (out, lse)
        if self.lm_ids.shape[-1] > 0:
            fc = self._fused
            if fc is None or fc[0] is not self.landmarks:  # per compression (or batch reorder): the constants
                lm_valid = None if self._lm_all_valid else self.lm_ids < self.n_chunks.view(B, 1, 1)  # [B, H, Cl]
                ar = torch.arange(self.chunk, device=query.device)
                vbase = (torch.arange(B * H, device=query.device) * N).view(B, H, 1, 1) + ar
                off = self.rope_base.view(B, 1, 1, 1).long() + ar if self.rope_base is not None else None
                fc = self._fused = (self.landmarks, self.landmarks.float(), lm_valid, ar,
                                    (torch.arange(B, device=query.device) * N).view(B, 1, 1, 1) + ar, vbase, off)
            _, lm, lm_valid, ar, ubase, vbase, off = fc
            G = query.shape[1] // H
            # landmarks as the left operand: contiguous, so the batched matmul copies nothing
            s = torch.matmul(lm, query.float().view(B, H, G, D).transpose(-1, -2)).transpose(-1, -2)
            s = s * (D ** -0.5)  # [B, H, G, Cl]
            if lm_valid is not None:
                s = s.masked_fill(~lm_valid[:, :, None], float("-inf"))
                s = torch.softmax(s, dim=-1).nan_to_num_(0.0).amax(dim=2).masked_fill_(~lm_valid, float("-inf"))
            else:
                s = torch.softmax(s, dim=-1).amax(dim=2)
            top = s.topk(min(self.budget // self.chunk, s.shape[-1]), dim=-1)
            ids = self.lm_ids.gather(-1, top.indices).long()[..., None] * self.chunk  # [B, H, k, 1] first tokens
            K = ids.shape[2] * self.chunk
            ok = None  # chunks not selected (a row with fewer than k chunks): not read
            if lm_valid is not None:
                ok = (top.values > float("-inf"))[..., None].expand(B, H, top.values.shape[-1], self.chunk)
                ok = ok.reshape(B, H, K)
            half = self.info.shared.rope_half(self.info.rope, self._rope_hi, query.device)
            tok = (ids + ar).view(B, H, K)
            if ok is not None:
                tok = tok.masked_fill(~ok, -1)
            kw = (dict(position_offset=self.rope_base.view(B)) if self.rope_base is not None
                  else dict(positions=self.rope_pos))
            # the exact outliers and local + generated slots join the same softmax (every slot a decode
            # query sees is before it: only dead slots, pos < 0, are skipped)
            exact = [(self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)]
            r = lowrank_token_decode(query, self.U, self.SV, self.v_off, tok, half, scale=scaling, exact=exact, **kw)
            if r is not None:  # the kernels package's fused CPU kernel took the whole step
                return r[0].transpose(1, 2).to(query.dtype)
            else:
                u = self.U.view(B * N, r).index_select(0, (ubase + ids).view(-1)).view(B, H, K, r)
                dt = torch.float64 if self.U.dtype == torch.float64 else torch.float32
                k_pre = torch.matmul(u.to(dt), self.SV.to(dt))  # [B, H, K, D]
                if off is not None:
                    pos = (off + ids).view(-1)
                else:
                    pos = self.rope_pos.long().view(-1).index_select(0, (ubase + ids).view(-1))
                if half is not None:  # HF rotate_half layout: cos/sin repeat their first Dr/2 columns
                    hc, hs = half
                    h2 = hc.shape[-1]
                    cos = hc.index_select(0, pos).view(B, H, K, h2).to(dt)
                    sin = hs.index_select(0, pos).view(B, H, K, h2).to(dt)
                    x1, x2 = k_pre[..., :h2], k_pre[..., h2 : 2 * h2]
                    parts = [(x1 * cos).addcmul_(x2, sin, value=-1), (x2 * cos).addcmul_(x1, sin)]
                    if 2 * h2 < D:
                        parts.append(k_pre[..., 2 * h2 :])
                    k_sel = torch.cat(parts, -1).to(query.dtype)
                else:
                    cos, sin = self.info.shared.rope_table(self.info.rope, self._rope_hi, query.device)
                    cos = cos.index_select(0, pos).view(B, H, K, -1).to(dt)
                    sin = sin.index_select(0, pos).view(B, H, K, -1).to(dt)
                    k_sel = apply_rope(k_pre, cos, sin).to(query.dtype)
                ks.append(k_sel)
                vs.append(self.v_off.reshape(B * H * N, D).index_select(0, (vbase + ids).view(-1)).view(B, H, K, D))
                ps.append(torch.where(ok, 0, -1).to(torch.int32) if ok is not None
                          else torch.zeros((), dtype=torch.int32, device=query.device).expand(B, H, K))
        for k, v, pos in ((self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)):
            if k.shape[-2] > 0:
                ks.append(k)
                vs.append(v)
                ps.append(pos.expand(B, H, -1))
        if not done and len(ks) == 1:
            return attend_slots(query, ks[0], vs[0], ps[0], qpos, scaling)
        if len(ks) > 1 and sum(k.numel() for k in ks) <= self.concat_below:  # small: one attention over them all
            ks, vs, ps = [torch.cat(ks, 2)], [torch.cat(vs, 2)], [torch.cat(ps, 2)]
        if not done and len(ks) == 1:
            return attend_slots(query, ks[0], vs[0], ps[0], qpos, scaling)
        for k, v, pos in zip(ks, vs, ps):  # large: one attention per part, merged by LSE (copies nothing)
            o, l_ = attend_slots(query, k, v, pos, qpos, scaling, return_lse=True)
            done.append((o.transpose(1, 2), l_))  # [B, Hq, 1, D]
        out, lse = done[0]
        for o, l_ in done[1:]:
            out, lse = merge_attn(out, lse, o, l_)
        return out.transpose(1, 2)

    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """Sparse attention for ``query [B, Hq, T, D]`` at positions ``qpos [T]``; returns ``[B, T, Hq, D]``:
        the selected low-rank chunks, the exact outliers and the exact local + generated slots, merged by LSE.
        A single token on the CPU (values in the same memory) takes :meth:`_decode_one_cpu`."""
        if (query.shape[2] == 1 and query.device.type == "cpu" and self.v_off.device == query.device
                and self.fused_cpu_step):
            return self._decode_one_cpu(query, qpos, scaling).to(query.dtype)
        out = lse = None
        if self.lm_ids.shape[-1] > 0:
            out, lse = self._lowrank(query, self._select(query), scaling)
        # outliers (prompt tokens, always before the queries) and the local + generated slots (causal)
        for k, v, pos in ((self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)):
            if k.shape[-2] == 0:
                continue
            o, l_ = attend_slots(query, k, v, pos, qpos, scaling, return_lse=True)
            o = o.transpose(1, 2)  # [B, Hq, T, D]
            out, lse = (o, l_) if out is None else merge_attn(out, lse, o, l_)
        return out.transpose(1, 2).to(query.dtype)
