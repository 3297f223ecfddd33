"""Per-instance fused kernels for a Llama-family model the engine serves on CUDA.

``apply_fused_kernels(model, config)`` (called once from ``ModelRunner.__init__``) switches the
modules of ONE model instance to the kernels of ``cache_node.kernels.fused_ops``, when the
resolved config runs on CUDA with the triton attention backend and ``fused_kernels`` on; on
CPU, with the torch backend, with ``fused_kernels=False``, or for a model that is not a
``LlamaForCausalLM`` built of transformers' stock Llama modules, nothing changes.

Only instance attributes change (``module.forward`` set on the module, buffers registered on
it); transformers' classes and module-level functions are never touched, so another copy of
the weights (a ``copy.deepcopy`` made before patching, e.g. the benches' transformers peer)
keeps running stock transformers code. Per instance:

- every ``LlamaRMSNorm`` (two per layer and the final norm): ``fused_ops.rms_norm``;
- every ``LlamaMLP`` with ``hidden_act == "silu"``: one GEMM over gate and up (``fused_ops.
  fused_mlp``);
- every ``LlamaAttention``: its forward re-implemented here, because the rotary embedding is a
  module-level function its forward calls (``apply_rotary_pos_emb``) and cannot be swapped per
  instance otherwise: one QKV GEMM, ``fused_ops.rotary_embedding`` (q and k in one launch,
  written contiguous), then the same call of transformers' attention interface
  (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)``) with the same
  arguments as transformers' ``LlamaAttention.forward`` (5.17 to 5.25), then ``o_proj``. A call
  with a KV cache object (``cache``/``past_key_values``, never passed by the engine) runs the
  stock forward.

The concatenated weights (gate|up, q|k|v) are built once and registered on the module as
non-persistent buffers; the original ``weight`` (and ``bias``) parameters are rebound to views
of them, so both hold the same values in the same memory (no second copy of the weights) and
the stock forwards and anything reading ``gate_proj.weight`` see the same numbers. A later
``model.to(...)`` (or ``.cuda()``, ``.half()``: ``Module._apply``) converts the parameters and
the buffer separately; the patched module's ``_apply`` then rebinds the parameters to views of
the converted buffer, so they stay one copy and a ``load_state_dict`` after the move still
reaches the fused GEMMs.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cache_node.config import EngineConfig

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedModel

FUSED_ATTR = "_kvstrata_fused"  # set on a patched module (and the model): True
FUSED_LINEARS_ATTR = "_kvstrata_fused_linears"  # (fused name, child linear names)


def fused_kernels_apply(config: EngineConfig) -> bool:
    """Whether a resolved config runs the fused kernels: CUDA, triton backend, ``fused_kernels``."""
    return (config.device.startswith("cuda") and config.attention_backend == "triton"
            and config.fused_kernels)


def apply_fused_kernels(model: PreTrainedModel, config: EngineConfig) -> int:
    """Patch ``model`` (one instance) to the fused kernels when ``fused_kernels_apply(config)``.

    Returns:
        The number of modules patched now: 0 when the config does not apply, the model is not a
        Llama (``model_type != "llama"``) or it is patched already.
    """
    if not fused_kernels_apply(config):
        return 0
    return patch_model(model)


def patch_model(model: PreTrainedModel) -> int:
    """Patch every stock Llama RMSNorm, SiLU MLP and attention module of ``model`` (on any device;
    on CPU only under Triton's interpreter, as the tests do). Returns the number patched;
    idempotent (a patched model returns 0)."""
    from transformers.models.llama import modeling_llama as llama

    if getattr(model.config, "model_type", None) != "llama" or getattr(model, FUSED_ATTR, False):
        return 0
    patched = 0
    for module in model.modules():
        kind = type(module)
        if kind is llama.LlamaRMSNorm:
            patched += _patch(module, _rms_norm_forward)
        elif kind is llama.LlamaMLP and getattr(module.config, "hidden_act", None) == "silu":
            _fuse_linears(module, "gate_up", ["gate_proj", "up_proj"])
            patched += _patch(module, _mlp_forward)
        elif kind is llama.LlamaAttention:
            _fuse_linears(module, "qkv", ["q_proj", "k_proj", "v_proj"])
            patched += _patch(module, _attention_forward)
    setattr(model, FUSED_ATTR, True)
    return patched


def is_patched(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a model or one of its modules) runs the fused kernels."""
    return bool(module.__dict__.get(FUSED_ATTR, False))


def _patch(module: torch.nn.Module, forward: Any) -> int:
    module.forward = types.MethodType(forward, module)
    setattr(module, FUSED_ATTR, True)
    return 1


def _fuse_linears(module: torch.nn.Module, name: str, linears: list[str]) -> None:
    """Register ``_kvstrata_<name>_weight`` (and ``_bias``) = the rows of the linears named
    ``linears`` (children of ``module``) concatenated, and rebind each linear's parameters to its
    rows of it (same values, one copy in memory), now and after every ``module._apply`` (a
    ``.to()`` of the model).

    Raises:
        ValueError: some of the linears have a bias and others not.
    """
    children = [getattr(module, child) for child in linears]
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in children])
        biases = [lin.bias for lin in children]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        if bias is None and any(b is not None for b in biases):
            raise ValueError(f"{type(module).__name__}: some of its projections have a bias, others not")
    module.register_buffer(f"_kvstrata_{name}_weight", weight, persistent=False)
    module.register_buffer(f"_kvstrata_{name}_bias", bias, persistent=False)
    module.__dict__[FUSED_LINEARS_ATTR] = (name, tuple(linears))
    _bind_views(module)
    module._apply = types.MethodType(_apply_and_rebind, module)  # type: ignore[method-assign]


def _apply_and_rebind(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` (children first, then this module's buffers), then ``_bind_views``."""
    out = type(self)._apply(self, fn, recurse)
    _bind_views(self)
    return out


def _bind_views(module: torch.nn.Module) -> None:
    """Point each fused linear's ``weight``/``bias`` at its rows of the module's fused buffers."""
    name, linears = module.__dict__[FUSED_LINEARS_ATTR]
    weight = getattr(module, f"_kvstrata_{name}_weight")
    bias = getattr(module, f"_kvstrata_{name}_bias")
    with torch.no_grad():
        start = 0
        for child in linears:
            lin = getattr(module, child)
            rows = slice(start, start + lin.weight.shape[0])
            lin.weight.data = weight[rows]
            if bias is not None:
                lin.bias.data = bias[rows]
            start = rows.stop


def _rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    from cache_node.kernels.fused_ops import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    from cache_node.kernels.fused_ops import fused_mlp

    return fused_mlp(x, self._kvstrata_gate_up_weight, self.down_proj.weight,
                     self._kvstrata_gate_up_bias, self.down_proj.bias)


def _attention_forward(self: Any, hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       attention_mask: torch.Tensor | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``LlamaAttention.forward`` with one QKV GEMM and the fused rotary kernel."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from cache_node.kernels.fused_ops import rotary_embedding

    if position_embeddings is None or any(kwargs.get(k) is not None for k in ("cache", "past_key_values")):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    head_dim = self.head_dim
    q_width, kv_width = self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]
    qkv = F.linear(hidden_states, self._kvstrata_qkv_weight, self._kvstrata_qkv_bias)
    q = qkv[..., :q_width].reshape(-1, q_width // head_dim, head_dim)
    k = qkv[..., q_width : q_width + kv_width].reshape(-1, kv_width // head_dim, head_dim)
    cos, sin = position_embeddings
    q, k = rotary_embedding(q, k, cos, sin)  # new contiguous (tokens, heads, head_dim)
    query_states = q.view(*input_shape, -1, head_dim).transpose(1, 2)
    key_states = k.view(*input_shape, -1, head_dim).transpose(1, 2)
    value_states = qkv[..., q_width + kv_width :].view(*input_shape, -1, head_dim).transpose(1, 2)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
