"""SentenceKV: sentence-level semantic KV caching with recall from the host tier.

Device tier per sequence and layer::

    pool blocks:    | sinks | window | new ... |
    recall region:  (H_kv, R) slots: each KV head's promoted sentences (attended as extra KV),
                    as int8 codes with per-group scales by default (``region_bits``)
    sentence index: a 2-bit key sketch of every demoted token (or one mean key per sentence)

Every token outside sinks and the recent window is grouped into sentences; a sentence's raw
K/V goes to the engine's host tier (slots the sequence reserves there, counted in the host
budget and freed with the sequence; its own CPU tensors when the engine has no host tier,
charged to the device pool then) and only its index stays on the device tier (index and
region are charged to the pool as whole blocks: ``SequenceKV.charge_blocks``). Before each layer attends,
the step's queries score every sentence per KV head (best over the step's queries and the
head's query group) and each head promotes its best sentences into its own R region slots; in
a multi-token step the last query picks first, up to ``last_query_share`` of R. KV is copied
from the host only for heads whose selection changed; decoding one token per step, recall
follows every decode step (every k-th with ``recall_every``). A prompt prefilled over demoted
sentences (a session turn, a compressed prefix's fork) selects per span of 16 positions
counted back from the prompt's end, never per scheduler chunk, and the scheduler never
splits a span (``SentenceRecall.prompt_span``, ``cache_node.query_spans``): the output does
not depend on the token budget or on other requests. Budget = the pool blocks (sinks + window + ``headroom_blocks`` blocks) + R +
the index, in token-equivalent bytes. Fields a spec leaves out come from a preset chosen by the
budget (``SentenceKV.preset``: "compact" at 1/8 of the prompt or less, "standard" above).

Recall region precision (``region_bits``): 8 (default) or 4 quantizes each promoted token's K/V
per KV head and group of ``region_group`` channels (asymmetric, float16 scale and zero) as it
is copied in, and attention runs on the codes (HACK §4), so the bytes left for the region hold
3.2x (int8) or 5.3x (int4) the tokens of float32 K/V; sinks and the window stay in full
precision (KIVI §3). A decode step dequantizes one layer's region into a transient buffer
and attends it with the pool's K/V in one fused call (``SequenceKV.attend_decode``: fewer
ops; the stored region stays coded). 0 keeps the pool's dtype (the paper's setting). A sentence is quantized
once, as it is demoted: its codes wait in host RAM beside its raw K/V (charged to the host
tier) and a promotion copies them. On SmolLM2-135M with 512-token
Wikipedia contexts at a 25% budget, mean KL against the full cache fell from 0.167 (float32
region) to 0.019 (int8) (bench/README.md).

Scoring (``select_mode``):
- ``"sketch"`` (default): the log of the softmax mass a sentence's tokens would receive,
  ``logsumexp_t(scaling * q . k_t)``, computed on 2-bit per-token key codes with per-group
  scales (``q . k = sum_g s_g (q_g . c_g) + z_g sum(q_g)``: on the codes, as in HACK §4). A
  sketch token costs 1/16 of a token's fp32 KV. This departs from the paper's scorer: on
  SmolLM2-135M with 1k-token Wikipedia contexts at a 25% budget, ``cos(q, mean_key)`` selection
  gave mean KL 0.23-0.26 against the full cache, sketch selection 0.02 (bench/README.md).
- ``"cos"``: ``cos(q, mean_key)`` with one mean key per sentence, layer and KV head (the
  paper's §3.3); an inner-product shortlist (matmul and top-k) when the candidate set is large.
- ``"mass"``: ``scaling * q . mean_key + log(len)``; ``"mean"``: cos with the chunk's mean query.

Sources: Zhu et al., "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV
Caching" (arXiv 2504.00970), §3.2 (sentence-level compression at prefill: semantic vectors on
GPU, token KV offloaded to CPU) and §3.3 (decode: select sentences by query similarity and load
their KV); Zhang et al., "HACK" (arXiv 2502.03589) §4 (attention scores on quantized codes);
Cai et al., "PyramidKV" (arXiv 2406.02069) §3 (layer-wise KV budgets, which ``layer_budget``
measures instead of fixing).

Files: ``sketch.py`` (``KeySketch``, the 2-bit key sketch scored on its codes;
``LayeredSketch``, finer codes in the deep layers), ``host_kv.py``
(``PrivateHostKV``, ``TierHostKV``: where a sentence's raw K/V waits in host RAM),
``region.py`` (``SentenceCodes``, the recall region's codes made at demotion;
``SentenceRegion``/``QuantSentenceRegion``, the region attended as extra KV), ``store.py``
(``HostSentenceStore``: the demoted sentences, their index and the region), ``shortlist.py``
(``shortlist`` and ``head_scores`` over mean keys), ``layer_budget.py`` (the region's split
among the layers, ``layer_budget="mass"``), ``bound.py`` (``KeyBounds``, the missed-mass
bound and its stats), ``bound_step.py`` (one layer's bound per step), ``overflow.py`` (the
exact-recall overflow region), ``policy.py`` (``SentenceKV``, registered as ``sentencekv``:
its fields, checks, segmentation and demotion), ``recall.py`` (its recall at attention time),
``budget.py`` (its accounting), ``presets.py`` (``PRESETS``, the fields a spec leaves out).
"""

from cache_node.policies.sentencekv.host_kv import PrivateHostKV, TierHostKV
from cache_node.policies.sentencekv.policy import SentenceKV
from cache_node.policies.sentencekv.region import QuantSentenceRegion, SentenceCodes, SentenceRegion
from cache_node.policies.sentencekv.shortlist import SHORTLIST_MIN_SENTENCES, head_scores, shortlist
from cache_node.policies.sentencekv.sketch import KeySketch, LayeredSketch
from cache_node.policies.sentencekv.store import HostSentenceStore

__all__ = [
    "SHORTLIST_MIN_SENTENCES", "HostSentenceStore", "KeySketch", "LayeredSketch", "PrivateHostKV", "QuantSentenceRegion",
    "SentenceCodes", "SentenceKV", "SentenceRegion", "TierHostKV", "head_scores", "shortlist",
]
