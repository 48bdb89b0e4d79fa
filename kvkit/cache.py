"""``KVCache``: a ``transformers.Cache`` whose layers are kvkit policy stores.

Every store counts the tokens it has *seen* (``get_seq_length``), so position ids stay right after
eviction, and reports the bytes it really holds (``nbytes``).
"""

from __future__ import annotations

from transformers.cache_utils import Cache

from kvkit.model_info import layer_infos, make_rope_fn
from kvkit.stores.full import SlidingStore


class KVCache(Cache):
    """A transformers ``Cache`` whose layers are the stores of a kvkit policy.

    ``KVCache(model)`` uses the policy ``kvkit.patch`` installed on the model (``full`` if none);
    ``KVCache(model, "streaming", budget=512)`` builds one for a given policy.
    """

    def __init__(self, model, policy=None, **options):
        from kvkit.registry import get_policy

        if policy is None:
            state = getattr(model, "_kvkit_state", None)
            policy = state.policy if state is not None and not options else "full"
        self.policy = get_policy(policy, **options)
        rope = make_rope_fn(model) if hasattr(model, "named_modules") else None
        self.infos = layer_infos(model, rope)
        self.shared: dict = {}
        for info in self.infos:
            info.shared = self.shared
        layers = []
        for info in self.infos:
            if info.layer_type in ("sliding_attention", "chunked_attention") and info.sliding_window:
                layers.append(SlidingStore(info, sliding_window=info.sliding_window))
            elif info.layer_type == "full_attention":
                layers.append(self.policy.new_layer(info))
            else:
                raise ValueError(
                    f"kvkit does not support attention layers of type {info.layer_type!r} "
                    f"(layer {info.layer_idx}); supported: full_attention, sliding_attention"
                )
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def nbytes(self, per_layer: bool = False):
        """Bytes of KV held on the layers' devices (total, or a list per layer)."""
        sizes = [layer.nbytes() for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def offloaded_nbytes(self, per_layer: bool = False):
        sizes = [layer.offloaded_nbytes() for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def read_nbytes(self, per_layer: bool = False):
        """K/V bytes a single-token decode step reads (total, or a list per layer); see
        ``StoreMixin.read_nbytes``. For TidalDecode: the last decode forward's reads."""
        sizes = [layer.read_nbytes() for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def num_slots(self) -> list[int]:
        return [layer.num_slots() for layer in self.layers]

    def __repr__(self) -> str:
        return f"KVCache(policy={self.policy!r}, seen={self.get_seq_length()}, nbytes={self.nbytes()})"
