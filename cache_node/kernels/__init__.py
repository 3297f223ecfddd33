"""GPU kernels for the cache node: Triton paged attention and its torch reference; fused
RMSNorm, SiLU-and-mul and rotary embedding (``fused_ops``, imports triton) with theirs.

``paged_attention`` imports triton; import it from ``cache_node.kernels.paged_attention`` only
where triton is installed. ``paged_attention_reference`` needs torch alone.
"""

from cache_node.kernels.reference import check_paged_attention_inputs, paged_attention_reference

__all__ = ["check_paged_attention_inputs", "paged_attention_reference"]
