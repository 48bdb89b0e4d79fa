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

Decode: per KV head, ``softmax(q . landmark / sqrt(D))`` in fp32, max over the query heads of the
group, top ``budget // chunk_size`` chunks; their keys are rebuilt as ``U[rows] @ (S*V^T)[head]``
with RoPE applied at the original positions, their values fetched from the offload store, and the
query attends over selected + outlier + local + generated tokens. Several query tokens in one
forward (speculative verification, chunked prefill) each pick their own chunks, so a T-token forward
equals T single-token forwards.

Why inverse RoPE instead of a hook: the cache only ever receives post-RoPE keys, and for the
rotate_half convention of transformers ``k = a*R(theta) k_pre`` (``a`` = the rope attention scaling,
1 for plain RoPE), so ``k_pre = (k*cos - rotate_half(k)*sin) / (cos^2 + sin^2)`` recovers the pre-RoPE
key exactly from the model's own ``(cos, sin)`` (``info.rope`` at the positions the model used, read
from the ``position_ids`` the attention function receives). No modeling code is hooked or copied and
any RoPE variant the model's rotary module implements (linear, dynamic, YaRN, llama3) is inverted.

Rank: the paper uses 160 for Llama-3-8B (``Hkv*D = 1024``); ``rank=None`` keeps that fraction,
``round(160 / 1024 * Hkv*D)`` (30 for SmolLM2-135M, ``Hkv*D = 192``). ``outliers=None`` scales the
paper's 48 chunks at budget 2048 with the budget.

Batches: rows share one stored length (left padding). Chunks are laid out from each row's first real
token, so padding never enters a chunk, the SVD (padding rows are zero, which leaves the singular
vectors of the real rows unchanged) or a landmark, and a padded row compresses as it would alone.
Whether to compress is decided once per batch on the stored prompt length.

Chunked prefill (``kvkit.prefill``): the prompt is compressed at the first single-token decode step
(or at the end of the first forward when that forward alone exceeds ``min_prompt``; later chunks of
such a prompt then stay exact). Not done (yet): reusing the value chunks fetched at the previous step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvkit.model_info import apply_rope, inverse_rope
from kvkit.policies.base import Policy, check_positive_int
from kvkit.registry import register
from kvkit.stores import LayerInfo, SlotStore, hf_sdpa
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
        SVD rank of the pre-RoPE keys; None: ``round(160 / 1024 * Hkv*D)`` (paper: 160 at ``Hkv*D = 1024``).
    chunk_size : int
        Tokens per chunk / landmark; 8 in the paper.
    outliers : int or None
        Outlier chunks per KV head kept exact; None: ``round(48 * budget / 2048)`` (paper: 48 at 2048).
    local_chunks : int
        Last chunks of the prompt kept exact (paper: 4 chunks = 32 tokens), plus ``S mod chunk_size``.
    min_prompt : int
        Only prompts longer than this are compressed (paper: 4096); shorter ones run as ``full``.
    """

    budget: int = PAPER_BUDGET  # ShadowKV sparse budget, 2048 tokens
    rank: int | None = None  # ShadowKV rank 160 at Hkv*D = 1024; None scales it to the model
    chunk_size: int = 8  # ShadowKV chunk size
    outliers: int | None = None  # ShadowKV: 48 outlier chunks at budget 2048; None scales with budget
    local_chunks: int = 4  # ShadowKV local window: 4 chunks (32 tokens)
    min_prompt: int = 4096  # ShadowKV applies to long contexts; shorter prompts behave as full

    description = "ShadowKV: low-rank pre-RoPE keys + landmarks on device, values offloaded, top-k chunks (2410.21465)"
    saves = "memory+reads"

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
        self.rank_for(kv * head_dim)

    def new_layer(self, info: LayerInfo):
        rank = self.rank_for(info.num_kv_heads * info.head_dim)
        return ShadowKVStore(info, self, rank)


class ShadowKVStore(SlotStore):
    """One layer of ShadowKV. Before compression it is a plain exact store (attention is transformers'
    own sdpa, as ``full``); after it, ``keys/values/pos`` hold only the exact local window + generated
    tokens and the compressed prompt lives in the tensors listed in ``_batch_tensors``."""

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
        self.compressed = False
        self.decoding = False
        self.rpos = None  # [B, n] int32 RoPE positions of the held tokens (only before compression)
        self.U = self.SV = self.landmarks = self.lm_ids = self.n_chunks = None
        self.out_k = self.out_v = self.out_pos = self.rope_base = self.rope_pos = self.v_off = None

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
        else:
            self.rope_base, self.rope_pos = None, rp.contiguous()

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
    def _select(self, qf: torch.Tensor):
        """Top chunks per (row, KV head, query token): token indices into the chunk area ``[B, H, T, K]``
        and their validity."""
        B, H, G, T, D = qf.shape
        c, Cl = self.chunk, self.lm_ids.shape[-1]
        k = min(self.budget // c, Cl)
        s = torch.einsum("bhgtd,bhcd->bhgtc", qf, self.landmarks.float()) / math.sqrt(D)
        lm_valid = self.lm_ids < self.n_chunks.view(B, 1, 1)  # [B, H, Cl]
        s = s.masked_fill(~lm_valid[:, :, None, None], float("-inf"))
        p = torch.softmax(s, dim=-1).amax(dim=2)  # [B, H, T, Cl]: max over the group's query heads
        sel = p.topk(k, dim=-1).indices  # [B, H, T, k]
        chunk = self.lm_ids.long()[:, :, None].expand(B, H, T, Cl).gather(-1, sel)
        valid = lm_valid[:, :, None].expand(B, H, T, Cl).gather(-1, sel)
        tok = (chunk[..., None] * c + torch.arange(c, device=qf.device)).flatten(3)  # [B, H, T, k*c]
        valid = valid[..., None].expand(B, H, T, k, c).flatten(3)
        return tok, valid

    def _rebuild_keys(self, tok: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys ``[B, H, T, K, D]`` (fp32) of chunk tokens ``tok [B, H, T, K]``."""
        B, H, T, K = tok.shape
        bidx = torch.arange(B, device=tok.device).view(B, 1, 1, 1)
        u = self.U[bidx, tok].float()  # [B, H, T, K, r]
        k_pre = torch.einsum("bhtkr,bhrd->bhtkd", u, self.SV.float())
        if self.rope_base is not None:
            rp = self.rope_base.view(B, 1, 1, 1).long() + tok
        else:
            rp = self.rope_pos.long()[bidx, tok]
        cos, sin = self.info.rope(rp.reshape(B, -1))
        shape = (B, H, T, K, cos.shape[-1])
        cos = cos.to(tok.device, torch.float32).view(shape)
        sin = sin.to(tok.device, torch.float32).view(shape)
        return apply_rope(k_pre, cos, sin)

    def _fetch_values(self, tok: torch.Tensor, device) -> torch.Tensor:
        """Values ``[B, H, T, K, D]`` of chunk tokens ``tok`` from the offload store."""
        B, H, T, K = tok.shape
        t = tok.to(self.v_off.device)
        bidx = torch.arange(B, device=t.device).view(B, 1, 1, 1)
        hidx = torch.arange(H, device=t.device).view(1, H, 1, 1)
        v = self.v_off[bidx, hidx, t]
        return v.to(device, non_blocking=True)

    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """Sparse attention for ``query [B, Hq, T, D]`` at positions ``qpos [T]``; returns ``[B, T, Hq, D]``."""
        B, Hq, T, D = query.shape
        H = self.keys.shape[1]
        G = Hq // H
        qf = query.float().view(B, H, G, T, D)
        logits, vals = [], []
        if self.lm_ids.shape[-1] > 0:
            tok, valid = self._select(qf)
            k_sel = self._rebuild_keys(tok)  # [B, H, T, K, D]
            v_sel = self._fetch_values(tok, query.device).float()
            s = torch.einsum("bhgtd,bhtkd->bhgtk", qf, k_sel) * scaling
            logits.append(s.masked_fill(~valid[:, :, None], float("-inf")))
            vals.append(("sel", v_sel))
        # outliers (exact, always visible: prompt tokens) and the exact local + generated slots (causal)
        s = torch.einsum("bhgtd,bhnd->bhgtn", qf, self.out_k.float()) * scaling
        logits.append(s.masked_fill((self.out_pos < 0)[:, :, None, None], float("-inf")))
        vals.append(("dense", self.out_v))
        s = torch.einsum("bhgtd,bhnd->bhgtn", qf, self.keys.float()) * scaling
        allowed = (self.pos[:, :, None, :] <= qpos.view(1, 1, T, 1)) & (self.pos[:, :, None, :] >= 0)  # [B,1,T,n]
        logits.append(s.masked_fill(~allowed[:, :, None], float("-inf")))
        vals.append(("dense", self.values))
        p = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # a query that sees nothing (padding) reads zeros
        out = torch.zeros(B, H, G, T, D, dtype=torch.float32, device=query.device)
        start = 0
        for kind, v in vals:  # three parts, not a loop over tokens or heads
            n = v.shape[-2]
            pv = p[..., start : start + n]
            if kind == "sel":
                out += torch.einsum("bhgtk,bhtkd->bhgtd", pv, v)
            else:
                out += torch.einsum("bhgtn,bhnd->bhgtd", pv, v.float())
            start += n
        return out.view(B, Hq, T, D).transpose(1, 2).to(query.dtype)
