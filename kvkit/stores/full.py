"""Uncompressed layers: ``FullStore`` (the ``full`` policy and every exact layer) and ``SlidingStore``
(layers the model itself runs with a sliding window)."""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvkit.stores.attend import causal_suffix_attention, folded_masked_attention, hf_sdpa, plain_sdpa_call
from kvkit.stores.base import LayerInfo, StoreMixin, crop_count, grow_in_place, tensor_bytes


class FullStore(StoreMixin, DynamicLayer):
    """No compression: exactly transformers' ``DynamicLayer`` (bit-identical attention), plus accounting.

    Between ``set_verifying(True)`` and ``set_verifying(False)`` (:func:`kvkit.speculative`'s verification
    forwards only) multi-token forwards use :func:`kvkit.stores.attend.causal_suffix_attention` (same math, not
    the same bits).
    """

    suffix_attention = False
    headroom = 64  # slots allocated past the held tokens, so decoding does not copy the whole KV every step

    def __init__(self, info: LayerInfo, **kwargs):
        super().__init__(**kwargs)
        self.info = info
        self._bufs: dict = {}  # append buffers (grow_in_place)

    def update(self, key_states, value_states, *args, **kwargs):
        """Append into preallocated storage: same values as ``DynamicLayer``'s ``torch.cat``, but the held K/V
        are a prefix view of a buffer with ``headroom`` free slots, re-allocated (one copy) only when full,
        instead of a copy of the whole layer at every decode step (compared with transformers' DynamicCache by
        ``kvkit speculate --baselines dynamic``, results/speculative).
        Crops shrink the view; the next update writes over the cropped slots. Anything that replaced
        ``keys`` (beam reordering, offloading) is detected and copied into a fresh buffer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        cur_k = self.keys if n else key_states[:, :, :0]
        cur_v = self.values if n else value_states[:, :, :0]
        self.keys = grow_in_place(self._bufs, "keys", cur_k, key_states, self.headroom)
        self.values = grow_in_place(self._bufs, "values", cur_v, value_states, self.headroom)
        return self.keys, self.values

    def reset(self) -> None:
        self._bufs = {}
        super().reset()

    def set_verifying(self, on: bool) -> None:
        self.suffix_attention = bool(on)

    def crop(self, tokens_to_remove: int) -> None:
        """Same rule as every kvkit store (:func:`kvkit.stores.crop_count`): ``-n`` removes n, ``m > 0`` keeps m."""
        self.rollback(crop_count(self.get_seq_length(), tokens_to_remove))

    def rollback(self, n: int, ends_round: bool = True) -> None:
        if n > 0 and self.is_initialized:
            self.keys = self.keys[..., :-n, :]
            self.values = self.values[..., :-n, :]

    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, headroom included (``nbytes`` counts the held tokens only)."""
        return tensor_bytes(*self._bufs.values()) if self._bufs else self.nbytes()

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def num_slots(self) -> int:
        return self.get_seq_length()

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if self.suffix_attention and not dropout and plain_sdpa_call(kwargs):
            out = causal_suffix_attention(query, key, value, attention_mask, scaling)
            if out is None:  # rows not aligned (padding, holes): the mask as given, K/V read once per K/V head
                out = folded_masked_attention(query, key, value, attention_mask, scaling)
            if out is not None:
                return out
        return hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


class SlidingStore(StoreMixin, DynamicSlidingWindowLayer):
    """A layer the model itself runs with a sliding window (Mistral, Gemma 2/3 local layers).

    Policies leave these layers to the model's own window: they are already bounded.
    """

    def __init__(self, info: LayerInfo, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.info = info

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def num_slots(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return hf_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    def check_rollback(self, n: int) -> None:
        """Raise ``ValueError`` where transformers' sliding layer would refuse ``crop(-n)`` (nothing changes)."""
        seen = self.get_seq_length()
        if n > seen:
            raise ValueError(f"cannot crop {n} tokens: the sliding layer {self.info.layer_idx} has seen only {seen}")
        if n > 0 and seen >= self.sliding_window and not getattr(self, "record_past", False):
            raise ValueError(
                f"sliding layer {self.info.layer_idx} has reached its window ({self.sliding_window}) and does not record "
                "past states, so it cannot roll back; call `activate_past_recording()` on the cache's sliding layers first"
            )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            self.rollback(crop_count(self.get_seq_length(), tokens_to_remove))
        else:
            self.rollback(-tokens_to_remove)

    def rollback(self, n: int, ends_round: bool = True) -> None:
        self.check_rollback(n)
        DynamicSlidingWindowLayer.crop(self, -n)
