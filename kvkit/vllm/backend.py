"""kvkit's CPU attention backend for vLLM: vLLM's own CPU backend, with the engine's plan asked at each seam.

``KvkitCPUAttentionBackend`` subclasses vLLM's ``CPUAttentionBackend`` and is registered in place of ``CPU_ATTN`` by
:func:`kvkit.vllm.register`. With no policy switched on for the engine, its builder and impl call vLLM's code and
nothing else (plugin off == vanilla).

With a policy, the engine's plan (:mod:`kvkit.vllm.plans`: one class per policy, from the switch,
:func:`kvkit.vllm.config.policy_from`) decides at four seams, and this module knows no policy by name:

* ``customize_spec``: the KV-cache spec the allocator gets (:meth:`~kvkit.vllm.plans.base.Plan.customize_spec`:
  packed pages, a block manager that frees blocks);
* the metadata builder, once per step: ``md.kvkit = plan.plan_step(builder, md, num_reqs, force_full)``, what the
  step's rows read, shared by every layer of the KV-cache group;
* the impl, per attention layer: ``plan.layer_state(impl, ctx)`` once (buffers such as key summaries), then
  ``plan.write(...)`` for every KV write and ``plan.forward(...)`` for every step with a ``md.kvkit``.

The plans call back :meth:`KvkitCPUAttentionBackendImpl.vllm_forward` / ``vllm_write`` (vLLM's own attention and KV
write, e.g. over a reduced block table) and the builder's :meth:`~KvkitCPUAttentionMetadataBuilder.sched`.

Benchmark switches are fields of :class:`BenchSwitches`, held by every builder through :data:`CONTEXT`
(:func:`force_full_reads` flips one between the steps of an in-process engine).

The same plans (a reduced ``block_table`` + ``seq_lens`` per decode row, built in the metadata builder) carry over to
a GPU backend whose kernel takes block tables and sequence lengths (FlashAttention's ``block_table`` /
``seqused_k``); that path is not built or tested here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from kvkit.vllm.config import policy_from
from kvkit.vllm.plans.base import LayerContext, Plan


class TensorParallel:
    """This process's tensor-parallel group, read from vLLM when asked (plans get it as ``LayerContext.tp``)."""

    def size(self) -> int:
        return get_tensor_model_parallel_world_size()

    def rank(self) -> int:
        return get_tensor_model_parallel_rank()

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` max-reduced in place over the TP group (unchanged without tensor parallelism)."""
        if self.size() > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return t


TP = TensorParallel()


@dataclass
class BenchSwitches:
    """Benchmark switches, read by the metadata builder at every step (flip them between ``engine.step()`` calls of
    an in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    force_full_reads : decode rows read every block this step (vLLM's own tables), without rebuilding the engine.
        The KV held (and, under ``streaming:free=1``, freed: that plan ignores the switch) is unchanged, so this
        compares reads step by step on the same engine, batch and cache; key summaries keep being updated, so
        tidal / quest can switch back.
    """

    force_full_reads: bool = False


@dataclass
class BackendContext:
    """What the backend's builders and impls hold besides the engine's config (``self.ctx``)."""

    bench: BenchSwitches = field(default_factory=BenchSwitches)
    last_plan: Plan | None = None  # the plan of the engine built last in this process (used without a config)

    def engine_plan(self, vllm_config) -> Plan | None:
        """The plan switched on for ``vllm_config``'s engine (None: off), remembered as :attr:`last_plan`."""
        self.last_plan = policy_from(vllm_config)
        return self.last_plan


#: the process's backend context (one engine per process in vLLM's workers)
CONTEXT = BackendContext()


def force_full_reads(on: bool) -> None:
    """Benchmark A/B switch: while on, decode rows read every block (``CONTEXT.bench.force_full_reads``)."""
    CONTEXT.bench.force_full_reads = bool(on)


class KvkitCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.ctx = CONTEXT
        self.policy = self.ctx.engine_plan(vllm_config)
        self.num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        if self.policy is not None and not self.policy.sliding_window_ok and self.window_size != -1:
            raise ValueError(
                f"kvkit.vllm: policy {self.policy.name!r} on a sliding-window model is not supported "
                "(the model's own window already bounds what attention reads)"
            )

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.policy is None or self.is_cross_attention or self.is_encoder_only_attention:
            return md
        md.kvkit = self.policy.plan_step(self, md, common_attn_metadata.num_reqs, self.ctx.bench.force_full_reads)
        return md

    def sched(self, md: CPUAttentionMetadata, seq_lens: torch.Tensor) -> torch.Tensor:
        """vLLM's scheduler metadata for ``md`` with other ``seq_lens``."""
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=md.query_start_loc,
            causal=md.causal, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal,
            kv_cache_dtype=self.kv_cache_dtype,
        )


class KvkitCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = CONTEXT
        vllm_config = get_current_vllm_config_or_none()
        self.kvkit_policy = self.ctx.engine_plan(vllm_config) if vllm_config is not None else self.ctx.last_plan
        self._layer_idx: int | None = None
        self.kvkit_state = None  # the plan's state of this layer (Plan.layer_state)
        if self.kvkit_policy is not None:
            num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers if vllm_config is not None else 0
            ctx = LayerContext(vllm_config, num_layers, self.attn_type == AttentionType.DECODER, TP)
            self.kvkit_state = self.kvkit_policy.layer_state(self, ctx)

    def kvkit_layer(self, layer) -> int:
        """The index of this impl's decoder layer (from vLLM's layer name)."""
        if self._layer_idx is None:
            self._layer_idx = extract_layer_index(layer.layer_name)
        return self._layer_idx

    def vllm_write(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's own KV write."""
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def vllm_forward(self, layer, query, key, value, kv_cache, md, output, output_scale=None, output_block_scale=None):
        """vLLM's own attention over the rows and block tables of ``md``."""
        return super().forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kvkit_policy is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.kvkit_policy.write(self, self.kvkit_state, layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = getattr(attn_metadata, "kvkit", None)
        if step is None or self.kvkit_policy is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        return self.kvkit_policy.forward(self, self.kvkit_state, step, layer, query, key, value, kv_cache,
                                         attn_metadata, output, output_scale, output_block_scale)


def duo_retrieval_heads(policy, vllm_config, local_kv_heads: int) -> torch.Tensor:
    """duo: ``[layers, local_kv_heads]`` bool (True: retrieval head) for this process's TP rank
    (:meth:`kvkit.vllm.plans.duo.DuoPlan.retrieval_heads` with this module's view of the TP group)."""
    return policy.retrieval_heads(vllm_config, local_kv_heads, TP)


class KvkitCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return KvkitCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return KvkitCPUAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        cfg = get_current_vllm_config_or_none()
        policy = policy_from(cfg) if cfg is not None else CONTEXT.last_plan
        return spec if policy is None else policy.customize_spec(spec)
