"""RoPE frequencies fixed for a node's whole context, so a token's KV never depends on its step.

transformers' "dynamic" (NTK) and "longrope" RoPE (``modeling_rope_utils.dynamic_rope_update``)
recompute their frequencies in every forward from ``max(position_ids) + 1``. The engine runs
every scheduled sequence in one flattened forward, so the frequencies of a step, and the keys
it writes into the pool, would follow the longest sequence in it: the same tokens at the same
positions got other keys when another tenant's long request shared their step, and a prefix-cache
hit (device, host or spill) served keys computed under other frequencies than a recompute.
Here they are computed once for the node's ``max_model_len`` (vLLM's static choice) and the
module is made static; the choice is part of the model identity (``pin_rope``'s suffix), so
nodes with another ``max_model_len`` never share such KV. Other RoPE types are static already
and left alone.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

PINNED_ATTR = "_kvstrata_rope_pin"  # (the module's own rope_type, max_model_len) once pinned


def varies_per_forward(rope_type: object) -> bool:
    """Whether transformers recomputes this RoPE type's frequencies in each forward."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def pin_rope(model: torch.nn.Module, max_model_len: int) -> str:
    """Fix every per-forward RoPE module of ``model`` at the frequencies and attention scaling its
    type gives for ``max_model_len`` tokens; returns the suffix the model identity takes
    (``"+rope=<type>@<max_model_len>"``, "" when no module varies). Idempotent for one
    ``max_model_len``; a model pinned for another is pinned again from its own type.

    Raises:
        ValueError: a module whose per-layer-type RoPE (a dict of types) varies per forward: it
            cannot be served with a prefix cache.
    """
    pinned: set[str] = set()
    for module in model.modules():
        own = getattr(module, PINNED_ATTR, None)
        rope_type = own[0] if own is not None else getattr(module, "rope_type", None)
        if isinstance(rope_type, dict) and any(varies_per_forward(t) for t in rope_type.values()):
            raise ValueError(f"RoPE types {rope_type} recompute their frequencies in each forward: a step's KV "
                             "would depend on the other sequences in it; not served")
        if not varies_per_forward(rope_type) or not hasattr(module, "inv_freq"):
            continue
        if own is None or own[1] != max_model_len:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](module.config, module.inv_freq.device,
                                                               seq_len=max_model_len)
            module.inv_freq = inv_freq.to(module.inv_freq)  # (a registered buffer: assigned in place of it)
            module.attention_scaling = scaling
            module.rope_type = "default"  # ``dynamic_rope_update`` then leaves the frequencies as they are
            setattr(module, PINNED_ATTR, (rope_type, max_model_len))
        pinned.add(rope_type)
    return "".join(f"+rope={t}@{max_model_len}" for t in sorted(pinned))
