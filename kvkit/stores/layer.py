"""What every kvkit cache layer is, whatever it holds: :class:`StoreMixin` (what a kvkit layer adds to transformers'
``CacheLayerMixin``: byte counts, the attention entry point, rollback and compiled-step hooks), :class:`SeenLength`
(transformers' length API for stores that count the tokens they have seen) and :func:`tensor_bytes`."""

from __future__ import annotations

from kvkit.compat import CacheLayerCompat
from kvkit.model_info import LayerInfo


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class StoreMixin(CacheLayerCompat):
    """What every kvkit layer store adds to transformers' ``CacheLayerMixin``."""

    info: LayerInfo
    #: why a decode step over this store cannot be compiled whole (``is_compileable`` False); None when it can
    compile_refusal: str | None = "its buffers and its read change shape as tokens arrive (no static variant)"

    def nbytes(self) -> int:
        """Bytes of KV data (and slot metadata) this layer holds on its device."""
        raise NotImplementedError

    def offloaded_nbytes(self) -> int:
        """Bytes this layer keeps off-device (e.g. ShadowKV's value store)."""
        return 0

    def allocated_nbytes(self) -> int:
        """Bytes allocated on the device, free append headroom included (``nbytes`` counts held data only)."""
        return self.nbytes()

    def read_nbytes(self) -> int:
        """K/V bytes one single-token decode step's attention reads from this layer (on-device data plus
        what it fetches from an offload store). Default: everything held on the device; policies that
        read a subset (TidalDecode's selected tokens, ShadowKV's chunks) override it."""
        return self.nbytes()

    def num_slots(self) -> int:
        """Token slots held (max over heads)."""
        raise NotImplementedError

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Attention of ``query [B, Hq, T, D]`` for this layer; returns ``[B, T, Hq, D]``."""
        raise NotImplementedError

    # ---- the rollback API (kvkit.speculative and transformers' assisted decoding use only this) ----------
    #: True when ``update`` returns only the new tokens, so transformers' own attention would read a wrong KV:
    #: such a store must only run behind kvkit's registered attention (``kvkit.patch``)
    needs_kvkit_attention = False

    def crop_floor(self) -> int:
        """The shortest length ``crop``/``rollback`` can go back to exactly (0: any)."""
        return 0

    def rollback(self, n: int, ends_round: bool = True) -> None:
        """Remove the newest ``n`` tokens exactly (``ValueError`` below ``crop_floor``). ``ends_round``: this
        rollback closes a speculative round (False for rollbacks inside a round, e.g. an assistant's)."""
        raise NotImplementedError

    def reserve(self, n: int) -> None:
        """Compress now if adding ``n`` tokens would trigger a compression, so the next ``n`` tokens stay exactly
        croppable (called before a speculative round)."""

    def check_rollback(self, n: int) -> None:
        """Raise ``ValueError`` if ``rollback(n)`` cannot be exact (nothing changes)."""
        if n > self.get_seq_length():
            raise ValueError(f"cannot crop {n} tokens: layer {self.info.layer_idx} has seen only {self.get_seq_length()}")

    def set_verifying(self, on: bool) -> None:
        """Multi-token forwards between ``set_verifying(True)`` and ``(False)`` are speculative verifications
        (causal over the cache, no padding); stores may take a faster exact path for them."""

    # ---- compiled steps (static stores; ``KVCache.before_compiled_step``) ------------------------------------
    def before_compiled_step(self, T: int) -> None:
        """Eager, right before a compiled forward of ``T`` new tokens: what the compiled step cannot do (a due
        compression event, room for ``T`` more tokens). Default: nothing."""

    def after_compiled_step(self, T: int) -> None:
        """Eager, right after that compiled forward: bring the host copies of the lengths forward by ``T`` (the
        compiled step only moved the device counters). Default: nothing."""


class SeenLength:
    """transformers' length API for stores that count the tokens they have *seen* (``self.seen``), whatever they
    hold: position ids stay right after eviction; the generic mask stays position-indexed (kvkit reads only its
    padding information)."""

    seen: int

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1
