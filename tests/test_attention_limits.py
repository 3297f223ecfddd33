"""A checkpoint's attention variants the paged attention does not compute are kept out of reach
(a sliding window: the context stays within it) or refused (soft-capping, sinks), never ignored.

Regression: transformers passes a layer's ``sliding_window`` to the attention function as a
keyword the engine's ``paged_attention_forward`` swallowed, and a Mistral-style checkpoint with
a 16-token window was served its whole 2048-token ``max_position_embeddings``: past 16 tokens
every query attended tokens the model never lets it see, so the KV of later layers and the
tokens differed from the model's, silently.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.outputs import InvalidRequestError
from cache_node.sampling_params import SamplingParams

SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}
CFG = EngineConfig(block_size=4, kv_pool_bytes=1 << 20)


def mistral(window: int | None) -> MistralForCausalLM:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=window, **SMALL)).eval()


def test_a_sliding_window_bounds_the_context() -> None:
    """The window is the context: a prompt past it is refused, not answered with full attention;
    within it (where windowed and full attention agree) the engine's greedy token is the model's."""
    model = mistral(16)
    prompt = [(7 * i) % 500 + 1 for i in range(12)]
    with torch.no_grad():
        want = int(model(torch.tensor([prompt])).logits[0, -1].argmax())  # the model's own attention
    eng = LLMEngine(model, CFG, "mistral")
    assert eng.max_model_len == 16
    with pytest.raises(InvalidRequestError, match="context is 16"):
        eng.add_request(prompt + prompt, SamplingParams(max_tokens=1))
    out = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.output_token_ids[0] == want
    assert (out.finish_reason, len(out.output_token_ids)) == ("length", 4)  # 12 + 4 = the window


def test_asking_for_more_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding window of 16 tokens"):
        LLMEngine(mistral(16), EngineConfig(block_size=4, kv_pool_bytes=1 << 20, max_model_len=64), "mistral")


def test_full_attention_checkpoints_keep_their_context() -> None:
    assert LLMEngine(mistral(None), CFG, "mistral").max_model_len == 2048
    torch.manual_seed(0)
    assert LLMEngine(LlamaForCausalLM(LlamaConfig(**SMALL)).eval(), CFG, "llama").max_model_len == 2048


def test_a_window_is_what_a_layer_hands_the_attention_not_an_attribute_name() -> None:
    """Regression (s38 review r4): the window was read from attention modules with a ``q_proj``,
    else from the config's ``sliding_window``. Phi-3's attention has a ``qkv_proj`` and slides on
    its config's window (Phi-3-mini-4k: 2047 of 4096 positions): it was served its whole
    ``max_position_embeddings``, attending past the window; a Llama whose config carries a stray
    ``sliding_window`` (Llama never slides) was cut to it. Now the window is the one each layer
    hands the attention function in a 1-token forward."""
    torch.manual_seed(0)
    phi3 = Phi3ForCausalLM(Phi3Config(sliding_window=16, pad_token_id=0, **SMALL)).eval()
    prompt = [(7 * i) % 500 + 1 for i in range(12)]
    with torch.no_grad():
        want = int(phi3(torch.tensor([prompt])).logits[0, -1].argmax())  # the model's own attention
    eng = LLMEngine(phi3, CFG, "phi3")
    assert eng.max_model_len == 16
    assert list(eng.generate([prompt], SamplingParams(max_tokens=1))[0].output_token_ids) == [want]
    torch.manual_seed(0)
    stray = LlamaForCausalLM(LlamaConfig(sliding_window=16, **SMALL)).eval()
    assert LLMEngine(stray, CFG, "llama").max_model_len == 2048


def test_soft_capped_attention_is_refused() -> None:
    """Gemma2 soft-caps its attention logits (``attn_logit_softcapping``), which the paged
    attention does not: the engine refuses the checkpoint instead of serving other tokens."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
                          attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="soft-caps its attention logits"):
        LLMEngine(Gemma2ForCausalLM(config).eval(), CFG, "gemma2")
