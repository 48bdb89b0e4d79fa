"""The evals' import path of :mod:`kvkit.workloads.peers` (the peer rows: caches users would pick instead of a
kvkit policy, run on the unpatched model)."""

from kvkit.workloads.peers import PEERS, cache_nbytes, is_peer, make_cache, peer_options, tensor_nbytes

__all__ = ["PEERS", "cache_nbytes", "is_peer", "make_cache", "peer_options", "tensor_nbytes"]
