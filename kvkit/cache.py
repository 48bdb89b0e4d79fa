"""``KVCache``: a ``transformers.Cache`` whose layers are kvkit policy stores.

Every store counts the tokens it has *seen* (``get_seq_length``), so position ids stay right after
eviction, and reports the bytes it really holds (``nbytes``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from kvkit.model_info import layer_infos, make_rope_fn, text_config
from kvkit.registry import available_policies, get_policy, policy_class
from kvkit.state import patch_state
from kvkit.stores.buffers import crop_count
from kvkit.stores.full import SlidingStore
from kvkit.stores.normal import to_normal_tensors


def static_policies() -> tuple[str, ...]:
    """The registered policies whose stores have a static variant (``KVCache(..., static=True)``; the policy
    class's ``static_capable``), in registry order."""
    return tuple(n for n in available_policies() if policy_class(n).static_capable)


#: the built-in policies with a static variant (:func:`static_policies` also sees policies registered later)
STATIC_POLICIES = static_policies()


def check_static(static, max_length) -> bool:
    """Validate the ``static`` / ``max_length`` options (of ``kvkit.patch`` and ``KVCache``); returns ``static``."""
    if static is None:
        static = False
    if not isinstance(static, bool):
        raise ValueError(f"static must be True or False, got {static!r}")
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive integer (tokens), got {max_length!r}")
        if not static:
            raise ValueError("max_length is the capacity of a static cache: pass static=True with it")
    return static


def _needs_prompt_length(policy) -> bool:
    """``policy`` resolves a ``compression_ratio`` knob from the prompt length (a static cache needs ``prompt_length``)."""
    return policy.compression_ratio is not None and type(policy).ratio_needs_length


def _element_size(model) -> int | None:
    """Bytes per element of the model's floating-point parameters (the K/V its attention produces); None: none."""
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    for p in params():
        if p.is_floating_point():
            return p.element_size()
    return None


class KVCache(Cache):
    """A transformers ``Cache`` whose layers are the stores of a kvkit policy.

    ``KVCache(model)`` uses the policy ``kvkit.patch`` installed on the model (``full`` if none) and the patch's
    ``static`` / ``max_length``; ``KVCache(model, "streaming", budget=512)`` builds one for a given policy.

    ``static=True`` builds every layer's static store (fixed-capacity buffers written at an index tensor, lengths
    on the device: a decode step of fixed shapes, ``is_compileable``) or raises ``ValueError`` for a policy that
    has none; ``max_length`` is the least capacity of its uncompressed layers (default: sized at the prefill, or by
    :meth:`ensure_capacity`; ``generate`` on a patched model sizes it to the prompt + ``max_new_tokens``).
    ``is_compileable`` (transformers' property: every layer compileable) is what ``generate`` reads to compile the
    decode step; :attr:`compile_refusal` says why not.

    ``prompt_length``: the length of the cache's first forward (the prefill; for a left-padded batch the padded
    length the forward sees). A static cache whose policy resolves a ``compression_ratio`` knob from the prompt
    length (a token budget, duo's head split, ...) needs it: its stores resolve the knob for it when built, exactly as
    a growing cache does at a prefill of that length (:mod:`kvkit.policies.knobs`), and a first forward of another
    length is refused (ValueError) rather than read with a knob resolved for another prompt. Without it such a cache
    is refused when built. Elsewhere (a growing cache, no ratio, zipcache's length-free ratio) it has no effect.
    kvkit's own ``generate``, ``kvkit.prefill``, the shared-prefill replay and the evals pass it.
    """

    #: some tensor was made under ``torch.inference_mode()`` (:meth:`leave_inference_mode`)
    inference_tensors = False
    #: rows of the batch the cache holds, set by its first forward (:meth:`match_batch`); None: not known
    batch_rows: int | None = None
    #: the first forward must have this many tokens (a static cache whose ratio was resolved for it); else None
    prompt_length: int | None = None

    def __init__(self, model, policy=None, *, static: bool | None = None, max_length: int | None = None,
                 prompt_length: int | None = None, **options):
        state = patch_state(model)
        inherited = False
        if policy is None:
            policy = state.policy if state is not None and not options else "full"
            if static is None and state is not None and not options:
                static, max_length = state.static, max_length if max_length is not None else state.max_length
                inherited = state.static_default
        if inherited and static and prompt_length is None and _needs_prompt_length(state.policy):
            static, max_length = False, None  # kvkit's CUDA default, not the caller's: the growing cache, as before
        static = check_static(static, max_length)
        if prompt_length is not None and (isinstance(prompt_length, bool) or not isinstance(prompt_length, int)
                                          or prompt_length <= 0):
            raise ValueError(f"prompt_length must be a positive integer (tokens of the first forward), got "
                             f"{prompt_length!r}")
        self.policy = get_policy(policy, **options)
        self.prompt_length = prompt_length if static and self._ratio_needs_length() else None
        self._model_config = getattr(model, "config", None)
        rope = make_rope_fn(model) if hasattr(model, "named_modules") else None
        self.infos = layer_infos(model, rope)
        self.shared = self.policy.new_shared(self.infos)
        element_size = _element_size(model)
        for info in self.infos:
            info.shared = self.shared
            info.static, info.max_length = static, max_length
            info.prompt_length, info.element_size = prompt_length, element_size
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
        n = getattr(text_config(self._model_config), "num_hidden_layers", None) if self._model_config else None
        if n is not None and len(layers) != n:
            raise ValueError(f"KVCache: {len(layers)} cache layers for a model with {n} decoder layers "
                             "(num_hidden_layers); kvkit needs one per decoder layer (kvkit.model_info.layer_infos)")
        super().__init__(layers=layers)
        if static and not self.is_compileable:
            raise ValueError(f"static=True: a {self.policy.name!r} cache for this model has a layer without a static "
                             f"store: {self.compile_refusal}. Policies with static stores: "
                             f"{', '.join(static_policies())}")
        #: a policy's own scoring forward is running (KVzip's reconstruction): its tokens are rolled back
        #: afterwards, so the context-length check and the policy's after-forward hook skip it
        self.scoring_pass = False
        self.inference_tensors = torch.is_inference_mode_enabled()

    def leave_inference_mode(self) -> None:
        """Before a write: under ``torch.inference_mode()`` note that the cache holds inference tensors; outside it,
        once, copy them into normal tensors (:func:`kvkit.stores.normal.to_normal_tensors`), since PyTorch refuses
        in-place writes to inference tensors there. A cache filled under inference mode (``kvkit.prefill`` or a
        forward) then decodes under ``no_grad`` (``generate``) as transformers' ``DynamicCache`` does."""
        if torch.compiler.is_compiling():
            return
        if torch.is_inference_mode_enabled():
            self.inference_tensors = True
        elif self.inference_tensors:
            to_normal_tensors(self.layers, self.shared)
            self.inference_tensors = False

    # ---- guards ------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"this KVCache has {len(self.layers)} layers but the model asked for layer {layer_idx}: it was built "
                "for another model; build it with kvkit.KVCache(model, ...) for the model you run"
            )
        self.leave_inference_mode()
        if layer_idx == 0 and not torch.compiler.is_compiling():
            self.check_prompt_length(key_states.shape[-2])
            self.match_batch(key_states.shape[0])
        layer = self.layers[layer_idx]
        if layer.needs_kvkit_attention:
            impl = getattr(self._model_config, "_attn_implementation", "kvkit")
            if impl != "kvkit":
                raise RuntimeError(
                    f"a {self.policy.name!r} KVCache is used by a model whose attention is {impl!r}, not kvkit's: its "
                    "compressed layers need kvkit's attention (transformers' own would read only the new tokens). Call "
                    f"kvkit.patch(model, {self.policy.name!r}) first (after kvkit.unpatch, start from a new cache)"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _ratio_needs_length(self) -> bool:
        return _needs_prompt_length(self.policy)

    def check_prompt_length(self, T: int) -> None:
        """Before the first forward (``T`` tokens): a static cache whose ``compression_ratio`` knob was resolved for
        ``prompt_length`` tokens refuses another length (ValueError); no-op otherwise (and once tokens were seen)."""
        n = self.prompt_length
        if n is None or T == n or self.scoring_pass or self.get_seq_length() != 0:
            return
        raise ValueError(f"this static {self.policy.name!r} cache resolved compression_ratio="
                         f"{self.policy.compression_ratio} for a first forward of prompt_length={n} tokens, but the "
                         f"first forward has {T}: its buffers and budgets belong to another prompt. Build the cache "
                         f"with prompt_length={T} (the padded length of the first forward), or give the policy's "
                         f"{self.policy.ratio_knobs[0]}=... instead of compression_ratio")

    # ---- rollback API (kvkit.speculative, transformers' assisted decoding) ------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """transformers' ``crop``, all layers or none: every layer is checked before any is cropped."""
        self.rollback(crop_count(self.get_seq_length(), tokens_to_remove))

    def rollback(self, n: int, ends_round: bool = True) -> None:
        """Remove the newest ``n`` tokens from every layer exactly, or raise ``ValueError`` and change nothing."""
        for layer in self.layers:
            layer.check_rollback(n)
        self.leave_inference_mode()
        for layer in self.layers:
            layer.rollback(n, ends_round=ends_round)

    def reserve(self, n: int) -> None:
        """Let every layer compress now so that the next ``n`` tokens stay exactly croppable."""
        self.leave_inference_mode()
        for layer in self.layers:
            layer.reserve(n)

    @contextmanager
    def verification(self):
        """Multi-token forwards inside are speculative verifications (see ``StoreMixin.set_verifying``)."""
        for layer in self.layers:
            layer.set_verifying(True)
        try:
            yield self
        finally:
            for layer in self.layers:
                layer.set_verifying(False)

    # ---- static caches (a compileable decode step) ---------------------------------------------------------
    @property
    def compile_refusal(self) -> str | None:
        """Why a decode step over this cache cannot be compiled whole (None when ``is_compileable``): the first
        layer that is not compileable and its store's reason."""
        for i, layer in enumerate(self.layers):
            if not layer.is_compileable:
                why = getattr(layer, "compile_refusal", None) or "not compileable"
                return f"layer {i} ({type(layer).__name__}): {why}"
        return None

    def ensure_capacity(self, n: int) -> None:
        """Let every static layer hold ``n`` tokens (prompt + new ones) without re-allocating: call it before a
        compiled decode loop (a compiled step cannot grow its buffers). No-op for growing layers."""
        self.leave_inference_mode()
        for layer in self.layers:
            if hasattr(layer, "ensure_capacity"):
                layer.ensure_capacity(n)

    def before_compiled_step(self, T: int) -> None:
        """Eager work before a compiled forward of ``T`` new tokens (``StoreMixin.before_compiled_step``)."""
        self.leave_inference_mode()
        for layer in self.layers:
            layer.before_compiled_step(T)

    def after_compiled_step(self, T: int) -> None:
        """Eager bookkeeping after it (``StoreMixin.after_compiled_step``)."""
        for layer in self.layers:
            layer.after_compiled_step(T)

    # ---- batch operations (beam search, batch expansion): in place on the layers ---------------------------
    def match_batch(self, rows: int) -> None:
        """Before a forward of ``rows`` rows: a cache of one row that has seen tokens (a shared context) is
        expanded to ``rows`` copies of it (:meth:`batch_repeat_interleave`, as transformers' ``DynamicCache``
        broadcasts one), for every policy alike; a cache of another batch size is refused (``ValueError``). An
        empty cache takes any batch (its first forward sets it)."""
        if self.get_seq_length() == 0:
            self.batch_rows = rows
            return
        have = self.batch_rows
        if have is None or have == rows:
            return
        if have != 1:
            raise ValueError(f"this KVCache holds a batch of {have} rows but the forward has {rows}: a cache continues "
                             "the batch it was filled with (or one row, which is repeated for every row); select its "
                             "rows first (cache.batch_select_indices) or fill a new KVCache for this batch")
        self.batch_repeat_interleave(rows)

    def reorder_cache(self, beam_idx):
        self.leave_inference_mode()
        return super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        self.leave_inference_mode()
        super().batch_repeat_interleave(repeats)
        if self.batch_rows is not None:
            self.batch_rows *= repeats

    def batch_select_indices(self, indices):
        self.leave_inference_mode()
        super().batch_select_indices(indices)
        self.batch_rows = None  # the next forward's rows are taken as they come

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
