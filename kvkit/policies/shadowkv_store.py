"""ShadowKV's layer state (:class:`ShadowKVStore`) and the glue between it and the compression and decode steps of
:mod:`kvkit.stores.lowrank`; the policy, its options and the method's description are in
:mod:`kvkit.policies.shadowkv`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kvkit.kernels import lowrank_decode, lowrank_token_decode, merge_attn
from kvkit.stores import LayerInfo, SlotStore, attend_slots, hf_sdpa
from kvkit.stores import tensor_bytes as _tensor_bytes
from kvkit.stores.lowrank import (
    attend_parts,
    chunk_layout,
    factorize_keys,
    gather_value_chunks,
    landmarks_and_outliers,
    outlier_slots,
    rebuild_keys,
    rope_layout,
    select_chunks,
    top_chunks,
)

if TYPE_CHECKING:  # annotations only: the policy (ShadowKV, kvkit.policies.shadowkv) is a Policy
    from kvkit.policies.base import Policy

PAPER_OUTLIERS, PAPER_BUDGET = 48, 2048  # ShadowKV: 48 outlier chunks at a 2048-token budget


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

    def __init__(self, info: LayerInfo, policy: Policy, rank: int):
        super().__init__(info)
        self.budget, self.chunk = policy.budget, policy.chunk()
        self.rank, self.n_out = rank, policy.num_outliers()
        self.n_out_given = policy.outliers is not None
        self.local_chunks, self.min_prompt = policy.local_chunks, policy.prompt_floor()
        self.offload, self.landmark = policy.offload, policy.landmark
        self.ratio = policy.compression_ratio
        self._clear()

    def budget_for(self, S: int, first: int, element_size: int | None = None) -> tuple[int, int]:
        """``(budget, outliers)`` for ``compression_ratio`` over a prompt of ``S`` held tokens (the first real one at
        ``first``): the multiple of ``chunk_size`` whose decode reads (:meth:`read_nbytes`' terms: landmarks, their
        ids, ``S*V^T``, the outlier chunks, the exact local window + the new token, and per selected token a row of
        ``U`` and a value row; outliers scaling with the budget as the paper's 48 at 2048) are nearest ``1 - r`` of
        what full reads (``element_size``: the K/V's, default the held keys')."""
        D = self.info.head_dim
        e, c, r = element_size or self.keys.element_size(), self.chunk, self.rank
        C = max((S - first) // c - self.local_chunks, 0)
        local = S - first - C * c + 1
        lmw = 2 * D if self.landmark == "minmax" else D
        full = 2 * D * e * (S + 1)
        best = None
        for k in range(1, C + 1):
            n_out = min(self.n_out if self.n_out_given else round(PAPER_OUTLIERS * k * c / PAPER_BUDGET), C)
            lm = C - n_out
            read = (lm * (lmw * e + 4) + r * D * 4 + (n_out * c + local) * (2 * D * e + 4)
                    + min(k, lm) * c * (r + D) * e)
            err = abs(read / full - (1 - self.ratio))
            if best is None or err < best[0]:
                best = (err, k * c, n_out)
        return (self.budget, self.n_out) if best is None else best[1:]

    def _clear(self) -> None:
        self._rope_params = None  # (inv_freq on the device or None, attention_scaling) of the rotary module
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
    def lazy_initialization(self, key_states, value_states) -> None:
        self.check_values_device(key_states.device)
        super().lazy_initialization(key_states, value_states)

    def check_values_device(self, device: torch.device) -> None:
        """A static store on CUDA needs its values on the device (``offload=False``): raise ValueError otherwise."""
        if self.static and self.offload and torch.device(device).type == "cuda":
            raise ValueError("shadowkv static=True on CUDA needs offload=False: a compiled decode step (a CUDA graph) "
                             "cannot gather values from host memory. Pass offload=False (values on the device) or "
                             "drop static=True (eager steps fetch the selected values from the host)")

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:
            self.compress_if_due()
        self.append(key_states, value_states)
        return key_states, value_states

    def compress_if_due(self) -> None:
        """At the first single-token step (an eager one, or before a compiled one): everything held so far is the
        prompt (covers chunked prefill), compressed when longer than ``min_prompt``."""
        if self.decoding:
            return
        self.decoding = True
        if not self.compressed and self.keys is not None and self.seen > self.min_prompt:
            self.compress()
            self.committed = self.seen

    def _drop_last(self, n: int) -> None:
        super()._drop_last(n)
        if self.rpos is not None:
            self.rpos = self.rpos[:, :-n]

    def nbytes(self) -> int:
        return super().nbytes() + self.off_slot_nbytes() + _tensor_bytes(self.first_pos)

    def off_slot_nbytes(self) -> int:
        """Device bytes outside the slots: the factors, landmarks, outliers, RoPE layout (and the values when not
        offloaded)."""
        return _tensor_bytes(self.rpos, self.U, self.SV, self.landmarks, self.lm_ids, self.n_chunks, self.out_k,
                             self.out_v, self.out_pos, self.rope_base, self.rope_pos,
                             None if self.offload else self.v_off)

    def offloaded_nbytes(self) -> int:
        return _tensor_bytes(self.v_off) if self.offload else 0

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

    def slots_bound(self) -> int | None:
        """The most slots held once the prompt is compressed (a static store's capacity): the exact local window, at
        most ``(local_chunks + 1) * chunk - 1`` tokens (the chunks' remainder included), plus the tokens generated up to
        ``max_length``. Known when the cache declares the first forward's length (``prompt_length``, which
        ``generate`` and ``kvkit.prefill`` pass) and that prompt is compressed (longer than ``min_prompt``); None
        otherwise (capacity ``max_length``, as any unbounded store). A longer prompt than declared (a chunked
        prefill) only leaves more room than needed; an eager forward that outgrows it re-allocates."""
        n, m = self.info.prompt_length, self.info.max_length
        if n is None or not m or n <= self.min_prompt:
            return None
        return (self.local_chunks + 1) * self.chunk - 1 + max(m - n, 0)

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
            if self.static and T == 1:  # a static step's mask has one column, not read (StaticSlots): by position
                return self.decode(query, torch.arange(self.seen - 1, self.seen, device=query.device,
                                                       dtype=torch.int32), scaling)
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
        first = self.first_pos.to(dev).long()  # [B]
        if self.ratio is not None:
            self.budget, self.n_out = self.budget_for(S, int(first.min()))
        n_chunks, tok, tok_valid = chunk_layout(first, S, self.chunk, self.local_chunks)
        N = tok.shape[1]
        if N == 0:  # too short to have chunks: stay exact
            return
        gidx = tok[:, None, :, None].expand(B, H, N, D)
        kc = keys.gather(2, gidx)  # [B, H, N, D] post-RoPE
        vc = values.gather(2, gidx)
        rp = self.rpos.gather(1, tok)  # [B, N] RoPE positions

        # pre-RoPE keys, exact inverse rotation, factored
        cos, sin = self.info.rope(rp)
        cos, sin = cos.to(dev, torch.float32)[:, None], sin.to(dev, torch.float32)[:, None]
        self.U, self.SV = factorize_keys(kc, cos, sin, tok_valid, self.rank)
        self.rope_base, self.rope_pos, self._rope_hi = rope_layout(rp, tok_valid)
        if self.info.rope is not None:  # the table and its layout check now (a compression event), not at decode
            self.info.shared.rope_half(self.info.rope, self._rope_hi, dev)

        # landmarks and outliers (post-RoPE keys, per KV head)
        self.landmarks, self.lm_ids, out_ids, chunk_valid = landmarks_and_outliers(kc, n_chunks, self.chunk,
                                                                                   self.n_out, self.landmark)
        self.n_chunks = n_chunks.to(torch.int32)
        self._lm_all_valid = bool((self.lm_ids < self.n_chunks.view(B, 1, 1)).all())
        self.out_k, self.out_v, self.out_pos = outlier_slots(kc, vc, out_ids, chunk_valid, tok, self.chunk)

        # values: offload store (pinned CPU memory on CUDA, a separate tensor on CPU), or on the device
        self.v_off = vc.to("cpu").pin_memory() if vc.is_cuda and self.offload else vc
        params = getattr(self.info.rope, "params", None)
        params = params() if params is not None else None
        self._rope_params = ((params[0].to(dev, torch.float32), params[1]) if params is not None else (None, 1.0))
        self._keep_local(first + n_chunks * self.chunk)
        self.rpos = None
        self.compressed = True

    def _keep_local(self, local_start) -> None:
        """Keep only the exact local window: the last stored tokens from the earliest ``local_start [B]`` (each row's
        first token after its chunks); a row's slots before its own start are masked (position -1)."""
        S, dev = self.keys.shape[2], self.keys.device
        Tt = int((S - local_start).max())
        pos = self.pos[..., S - Tt :]
        spos = torch.arange(S - Tt, S, device=dev)
        pos = torch.where(spos[None, None] >= local_start[:, None, None], pos, torch.full_like(pos, -1))
        self.keys = self.keys[..., S - Tt :, :].contiguous()
        self.values = self.values[..., S - Tt :, :].contiguous()
        self.pos = pos.contiguous()

    # ---- decode ------------------------------------------------------------------------------
    def _rope_kw(self) -> dict:
        """The chunk tokens' RoPE positions as the kernels take them: one offset per row, or one per token."""
        if self.rope_base is not None:
            return dict(position_offset=self.rope_base.view(self.rope_base.shape[0]))
        return dict(positions=self.rope_pos)

    def _lowrank(self, query: torch.Tensor, ids: torch.Tensor, scaling: float):
        """``lowrank_decode`` over the chunks ``ids``: (out ``[B, Hq, T, D]``, lse ``[B, Hq, T]``)."""
        dev = query.device
        inv, a = self._rope_params  # made at the compression, on the store's device
        # built only where lowrank_decode takes its torch path (the kernels package picks)
        table = lambda: self.info.shared.rope_table(self.info.rope, self._rope_hi, dev)  # noqa: E731
        v, gathered = self.v_off, False
        if v.device != dev:  # offloaded values: fetch the selected chunks' rows (in list order)
            v, gathered = gather_value_chunks(v, ids, self.chunk, self.U.shape[1], dev), True
        return lowrank_decode(query, self.U, self.SV, v, ids, self.chunk, inv, attention_scaling=a,
                              v_gathered=gathered, scale=scaling, return_lse=True, rope_table=table,
                              **self._rope_kw())

    def _fused_constants(self, device) -> tuple:
        """Per compression (or batch reorder) constants of :meth:`_decode_one_cpu`: ``(landmarks, fp32 landmarks,
        lm_valid [B, H, Cl] or None, arange(chunk), U row base [B, 1, 1, chunk], value row base [B, H, 1, chunk],
        RoPE position base [B, 1, 1, chunk] or None)``, kept while the landmarks tensor is the same."""
        fc = self._fused
        if fc is None or fc[0] is not self.landmarks:
            B, H, N = self.lm_ids.shape[0], self.lm_ids.shape[1], self.U.shape[1]
            lm_valid = None if self._lm_all_valid else self.lm_ids < self.n_chunks.view(B, 1, 1)  # [B, H, Cl]
            ar = torch.arange(self.chunk, device=device)
            vbase = (torch.arange(B * H, device=device) * N).view(B, H, 1, 1) + ar
            off = self.rope_base.view(B, 1, 1, 1).long() + ar if self.rope_base is not None else None
            fc = self._fused = (self.landmarks, self.landmarks.float(), lm_valid, ar,
                                (torch.arange(B, device=device) * N).view(B, 1, 1, 1) + ar, vbase, off)
        return fc

    def _decode_one_cpu(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode token on the CPU. Same selection as :func:`~kvkit.stores.lowrank.select_chunks` (unsorted, as
        the order of the read slots does not matter to a softmax: :func:`~kvkit.stores.lowrank.top_chunks`) and the
        same keys as :func:`lowrank_decode` (``U[rows] @ (S*V^T)[head]``, RoPE from the shared table, fp32). The
        selected chunks are attended by the C kernel behind :func:`kvkit.kernels.lowrank_token_decode` (keys rebuilt
        in registers, never stored) when it is available, together with the exact outliers and local + generated
        slots; else the keys are rebuilt in torch with half-width RoPE tables
        (:func:`~kvkit.stores.lowrank.rebuild_keys`) and the parts attended by
        :func:`~kvkit.stores.lowrank.attend_parts`. Returns ``[B, 1, Hq, D]``."""
        B = query.shape[0]
        H, D = self.SV.shape[1], self.SV.shape[-1]
        # the exact outliers and local + generated slots join the same softmax (every slot a decode query sees is
        # before it: only dead slots, pos < 0, are skipped)
        exact = [(self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)]
        parts = []  # (keys, values, slot positions) to attend
        if self.lm_ids.shape[-1] > 0:
            _, lm, lm_valid, ar, ubase, vbase, off = self._fused_constants(query.device)
            top = top_chunks(query, lm, lm_valid, self.budget // self.chunk)
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
            r = lowrank_token_decode(query, self.U, self.SV, self.v_off, tok, half, scale=scaling, exact=exact,
                                     **self._rope_kw())
            if r is not None:  # the kernels package's fused CPU kernel took the whole step
                return r[0].transpose(1, 2).to(query.dtype)
            rows = (ubase + ids).view(-1)
            pos = (off + ids).view(-1) if off is not None else self.rope_pos.long().view(-1).index_select(0, rows)
            table = lambda: self.info.shared.rope_table(self.info.rope, self._rope_hi, query.device)  # noqa: E731
            k_sel = rebuild_keys(self.U, self.SV, rows, pos, half, table, (B, H, K), query.dtype)
            v_sel = self.v_off.reshape(-1, D).index_select(0, (vbase + ids).view(-1)).view(B, H, K, D)
            p_sel = (torch.where(ok, 0, -1).to(torch.int32) if ok is not None
                     else torch.zeros((), dtype=torch.int32, device=query.device).expand(B, H, K))
            parts.append((k_sel, v_sel, p_sel))
        parts += [(k, v, pos.expand(B, H, -1)) for k, v, pos in exact if k.shape[-2] > 0]
        return attend_parts(query, parts, qpos, scaling, self.concat_below)

    def decode(self, query: torch.Tensor, qpos: torch.Tensor, scaling: float) -> torch.Tensor:
        """Sparse attention for ``query [B, Hq, T, D]`` at positions ``qpos [T]``; returns ``[B, T, Hq, D]``:
        the selected low-rank chunks, the exact outliers and the exact local + generated slots, merged by LSE.
        A single token on the CPU (values in the same memory) takes :meth:`_decode_one_cpu` (eager only). A compiled
        step before any compression (a prompt of at most ``min_prompt`` tokens) reads the exact slots."""
        if not self.compressed:
            return attend_slots(query, self.keys, self.values, self.pos, qpos, scaling)
        if (query.shape[2] == 1 and query.device.type == "cpu" and self.v_off.device == query.device
                and self.fused_cpu_step and not torch.compiler.is_compiling()):
            return self._decode_one_cpu(query, qpos, scaling).to(query.dtype)
        out = lse = None
        if self.lm_ids.shape[-1] > 0:
            k = min(self.budget // self.chunk, self.lm_ids.shape[-1])
            ids = select_chunks(query, self.landmarks, self.lm_ids, self.n_chunks, k, self._lm_all_valid)
            out, lse = self._lowrank(query, ids, scaling)
        # outliers (prompt tokens, always before the queries) and the local + generated slots (causal)
        for k, v, pos in ((self.out_k, self.out_v, self.out_pos), (self.keys, self.values, self.pos)):
            if k.shape[-2] == 0:
                continue
            o, l_ = attend_slots(query, k, v, pos, qpos, scaling, return_lse=True)
            o = o.transpose(1, 2)  # [B, Hq, T, D]
            out, lse = (o, l_) if out is None else merge_attn(out, lse, o, l_)
        return out.transpose(1, 2).to(query.dtype)
