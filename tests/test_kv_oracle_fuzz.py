"""KV-content oracle fuzz (review s34 A): every piece of KV the engine keeps is the KV its tokens
have, whatever eviction, demotion, preemption, compaction and session surgery did to it.

Output-comparing tests are blind to wrong KV that happens not to flip a greedy token; this one
compares the bytes. A seeded random mix of operations (new requests over shared "documents" in
two cache namespaces under several policies, compressed prefixes, session turns, aborts and stop
ends, ``rewind_session``, ``cut_session_turn`` with and without a ``lead``, ``demote_all``,
``demote_session``, ``close_session``, ``flush``, ``drop_namespace``, explicit spill prefetches)
runs on the tiny random Llama with ``block_size`` 4 and a 24-block device pool, so prefix-cache
eviction, watermark and allocation demotion, host promotion, spill put/install and preemption
happen all the time. After every step ``check_integrity()`` must pass and the plain layouts
(second point below) are compared; every ``CHECK_EVERY`` steps and at the end, under the engine
lock, ``Oracle.problems`` checks all of:

- every prefix-cached **device** block (``BlockPool.cached``), every **host-tier** entry and
  every block of the in-process **spill** store (RAM and disk, read back token-checked) equals
  the KV that a separate reference engine (its own copy of the weights, full cache, big pool, no
  tiers, flushed before each use) computes from scratch for the block's whole token chain (max
  |diff| <= 1e-3, fp32). The chain is found by recording every sequence's tokens and namespace
  and hashing them (``hash_prompt_blocks``), so a cached hash that no recorded chain explains is
  a problem too;
- every running request and idle session whose layout is plain (the full cache, or a policy
  that has not compacted) holds exactly the reference KV in its first ``num_computed_tokens``
  slots: this covers KV that is never hashed (a session's partial block, lent blocks, cut and
  rewound histories).

The reviewer's longer scripts (~75 runs of 150-300 steps, 8 policies) found no wrong KV and,
through the session invariant, L1 (a cancelled full-cache turn or a turn cut short left a
session counting KV it had no blocks for; ``SessionTable.check_integrity`` now fails on it).
This is the short deterministic variant: no automatic prefetch, and every spill transfer waited
for after each operation, so the transfer thread adds no nondeterminism. Half the new requests
are session turns, a session's next turn mostly keeps its policy (4 in 5) and half the aborts
hit a session turn, so cancelled turns over a history are common: on the code before L1's fix
(8c8aecb^) seed 3 fails at step 57 ("session s3 (full): 47 computed tokens in 0 blocks", the
plain-layout check, which runs after every step; the tiers are compared every ``CHECK_EVERY``
steps and at the end). A self-check shows the same checker catches a +1.0 put into one slot of a
cached block on the device, after its demotion to the host tier and after its push to spill, and
one put into an idle session's unhashed partial block.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.hashing import hash_prompt_blocks
from cache_node.model_loader import LoadedModel, tiny_llama
from cache_node.policies.base import PolicyEnv
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore
from tests.test_session_rewind_state import drain

BS = 4
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny Llama fp32 block: (L=2, K/V, BS, H_kv=2, d=16) x 4 bytes
POOL_BLOCKS, HOST_BLOCKS, SPILL_RAM_BLOCKS = 24, 12, 8
POLICIES = ("", "quant", "snapkv-0.5", "h2o-0.5", "sentencekv-0.5", "streaming-24", "gkv-0.5")
NAMESPACES = ("A", "B")
SESSIONS = ("s1", "s2", "s3")
TOL = 1e-3
STEPS = 100
CHECK_EVERY = 5


class Oracle:
    """The reference KV of token chains, and the chain behind every hash the engine may cache.

    ``note(ns, tokens)`` records a sequence's tokens (call it for every sequence the engine has
    seen, outputs included); ``problems()`` compares what ``eng`` (and ``store``) hold with the
    reference and returns one line per wrong or unexplained block (empty: all good).
    """

    def __init__(self, eng: LLMEngine, store: SpillStore | None) -> None:
        self.eng, self.store = eng, store
        ref_lm = tiny_llama(seed=0)  # its own weights: a forward that wrote into them shows up here
        self.ref = LLMEngine(ref_lm.model, EngineConfig(block_size=BS, kv_pool_bytes=1024 * BLOCK_BYTES,
                                                        max_num_batched_tokens=256, max_num_seqs=1),
                             ref_lm.model_id, ref_lm.eos_token_ids)
        assert self.ref.model_id == eng.model_id and self.ref.kv_format == eng.kv_format
        self.chains: dict[bytes, tuple[str, tuple[int, ...]]] = {}  # block hash -> (namespace, chain)
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}  # chain -> its last block's reference KV
        self.checked = Counter[str]()  # blocks / layouts compared, per kind

    def note(self, ns: str, tokens: list[int]) -> None:
        keys = (ns, self.eng.model_id, self.eng.kv_format)
        for i, h in enumerate(hash_prompt_blocks(tokens, BS, keys)):
            self.chains.setdefault(h, (ns, tuple(tokens[: (i + 1) * BS])))

    def note_running(self) -> None:
        for seq in self.eng.requests.values():
            self.note(seq.cache_namespace, seq.all_token_ids)

    def reference(self, chain: tuple[int, ...]) -> torch.Tensor:
        """(L, 2, BS, H_kv, d) KV of the last block of ``chain`` (a multiple of BS tokens),
        computed from scratch by the reference engine (every block of the chain memoized)."""
        if chain not in self.memo:
            ref = self.ref
            ref.flush()
            ref.generate([list(chain) + [1]], SamplingParams(max_tokens=1, ignore_eos=True), cache_namespace="ref")
            hashes = hash_prompt_blocks(list(chain), BS, ("ref", ref.model_id, ref.kv_format))
            ids = [ref.kv_manager.pool.cached[h].block_id for h in hashes]
            for i, kv in enumerate(ref.pool.read_blocks(ids)):
                self.memo[chain[: (i + 1) * BS]] = kv.clone()
        return self.memo[chain]

    def _compare(self, where: str, got: torch.Tensor, chain: tuple[int, ...], slots: int = BS) -> list[str]:
        self.checked[where.split(" ")[0]] += 1
        err = (got[:, :, :slots] - self.reference(chain)[:, :, :slots]).abs().max().item()
        if err <= TOL:
            return []
        return [f"{where}: KV differs from the reference by {err:.3g} (chain of {len(chain)} tokens)"]

    def problems(self) -> list[str]:
        """Every wrong or unexplained block on any tier and every wrong plain layout."""
        if self.store is not None:
            self.eng.wait_for_transfers()
        with self.eng._lock:
            bad = self._device() + self._host() + self._plain()
        return bad + self._spill()

    def plain_problems(self) -> list[str]:
        """Every wrong plain layout of a running request or idle session (cheaper: no tiers)."""
        with self.eng._lock:
            return self._plain()

    def _chain(self, where: str, h: bytes, tokens: tuple[int, ...] | None) -> tuple[int, ...] | str:
        if h not in self.chains:
            return f"{where}: hash explained by no recorded token chain"
        ns, chain = self.chains[h]
        if tokens is not None and tuple(tokens) != chain[-BS:]:
            return f"{where}: tokens {tuple(tokens)} but its hash is of a chain ending {chain[-BS:]} ({ns})"
        return chain

    def _device(self) -> list[str]:
        bad: list[str] = []
        for h, blk in list(self.eng.kv_manager.pool.cached.items()):
            where = f"device block {blk.block_id} (ref_cnt {blk.ref_cnt})"
            chain = self._chain(where, h, blk.token_ids)
            if isinstance(chain, str):
                bad.append(chain)
                continue
            bad += self._compare(where, self.eng.pool.read_blocks([blk.block_id])[0], chain)
        return bad

    def _host(self) -> list[str]:
        bad: list[str] = []
        host = self.eng.tiers.host
        for h in list(host.entries):
            entry = host.entries[h]
            where = f"host slot {entry.slot}"
            chain = self._chain(where, h, None)
            if isinstance(chain, str):
                bad.append(chain)
                continue
            bad += self._compare(where, host.data[:, :, entry.slot], chain)
        return bad

    def _spill(self) -> list[str]:
        if self.store is None:
            return []
        bad: list[str] = []
        held = [h for h, _ in self.store.held()]
        bad += [f"spill block {h.hex()[:12]}: hash explained by no recorded token chain"
                for h in held if h not in self.chains]
        held = [h for h in held if h in self.chains]
        if held:
            reply = self.store.get(held, [list(self.chains[h][1][-BS:]) for h in held])
            if len(reply.hashes) != len(held):
                bad.append(f"spill: {len(held) - len(reply.hashes)} held blocks not read back with their tokens")
            for h, row in zip(reply.hashes, reply.blocks):
                bad += self._compare(f"spill block {h.hex()[:12]}", torch.from_numpy(row), self.chains[h][1])
        return bad

    def _plain(self) -> list[str]:
        bad: list[str] = []
        for rid, seq in self.eng.requests.items():
            if not seq.is_finished and (seq.kv is None or not seq.kv.compacted) and not seq.num_evicted_tokens:
                bad += self._layout(f"request {rid} ({seq.policy or 'full'})", seq.block_table,
                                    seq.all_token_ids, seq.num_computed_tokens)
        for sid, sess in self.eng.sessions.sessions.items():
            if sess.active_request is None and not sess.compacted and not sess.num_evicted_tokens:
                bad += self._layout(f"session {sid} ({sess.policy or 'full'})", sess.blocks, sess.token_ids,
                                    sess.num_computed_tokens)
        return bad

    def _layout(self, label: str, blocks: list, tokens: list[int], computed: int) -> list[str]:  # type: ignore[type-arg]
        """The first ``computed`` slots of ``blocks`` hold the KV of ``tokens[:computed]``."""
        if -(-computed // BS) > len(blocks):
            return [f"{label}: {computed} computed tokens in {len(blocks)} blocks"]
        bad: list[str] = []
        for i in range(-(-computed // BS)):
            chain = list(tokens[: (i + 1) * BS])
            chain += [1] * ((i + 1) * BS - len(chain))  # a partial block: only its computed slots compared
            got = self.eng.pool.read_blocks([blocks[i].block_id])[0]
            bad += self._compare(f"{label} block {i} (id {blocks[i].block_id})", got, tuple(chain),
                                 min(BS, computed - i * BS))
        return bad


def make_node(lm: LoadedModel, root: Path) -> tuple[LLMEngine, SpillStore]:
    """The engine under test: small device pool, host tier, in-process spill store in ``root``."""
    cfg = EngineConfig(block_size=BS, kv_pool_bytes=POOL_BLOCKS * BLOCK_BYTES, max_num_batched_tokens=16,
                       max_num_seqs=4)
    tiers = TierConfig(host_bytes=HOST_BLOCKS * BLOCK_BYTES, demote_low_watermark=0.2, demote_high_watermark=0.4,
                       auto_prefetch=False)
    probe = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=tiers)
    store = SpillStore(root, BlockFormat(*probe.spill_block_spec()), SPILL_RAM_BLOCKS * BLOCK_BYTES, 1 << 30,
                       max_blocks_per_file=4)
    eng = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=tiers, spill=store)
    eng.policy_env = PolicyEnv(frozenset(range(0, 512, 9)))  # synthetic sentence ends for SentenceKV
    return eng, store


class Fuzz:
    """One seeded run: ``op()`` does one random operation, ``step()`` one engine step."""

    def __init__(self, eng: LLMEngine, oracle: Oracle, seed: int) -> None:
        self.eng, self.oracle, self.rng = eng, oracle, random.Random(seed)
        self.docs = [[self.rng.randrange(1, 500) for _ in range(self.rng.randrange(8, 40))] for _ in range(4)]
        self.live: dict[str, tuple[str, str | None]] = {}  # request id -> (namespace, session)
        self.turns: dict[str, tuple[list[int] | None, int]] = {}  # request id -> (history before, prompt len)
        self.session_ns: dict[str, str] = {}
        self.session_policy: dict[str, str] = {}
        self.n = 0
        self.counts = Counter[str]()

    def words(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(1, 500) for _ in range(self.rng.randrange(lo, hi))]

    def add(self) -> None:
        rng, eng = self.rng, self.eng
        ns, policy, sid, prefix_tokens = rng.choice(NAMESPACES), rng.choice(POLICIES), None, 0
        doc = list(rng.choice(self.docs))
        prompt = doc + self.words(1, 10)
        if rng.random() < 0.5:
            sid = rng.choice(SESSIONS)
            if any(s == sid for _, s in self.live.values()):
                sid = None
            elif (history := eng.session_history(sid)) and rng.random() < 0.8:
                prompt = history + self.words(1, 12)  # the next turn (else a new conversation)
                ns = self.session_ns.get(sid, ns) if rng.random() < 0.8 else ns
                policy = self.session_policy.get(sid, policy) if rng.random() < 0.8 else policy
        elif policy and rng.random() < 0.3:
            prefix_tokens = len(doc)  # a compressed prefix, stored and forked by policy spec
        rid = f"r{self.n}"
        self.n += 1
        held = eng.sessions.sessions.get(sid) if sid else None
        if held is not None and held.namespace != ns:  # a session keeps its namespace (review s36 E1):
            before = eng.session_history(sid)  # refused, unchanged, then sent again under its own
            with pytest.raises(PermissionError):
                eng.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid, cache_namespace=ns,
                                session_id=sid, tenant="t", policy=policy)
            assert eng.session_history(sid) == before and rid not in eng.requests
            self.counts["turns refused for their namespace"] += 1
            ns = held.namespace
        prefetch = rng.random() < 0.2
        eng.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True), request_id=rid,
                        cache_namespace=ns, session_id=sid, tenant="t", policy=policy, prefix_tokens=prefix_tokens,
                        prefetch=prefetch)
        if prefetch:
            eng.wait_for_transfers()  # the install lands before the next step, every run alike
        self.oracle.note(ns, prompt)
        self.live[rid] = (ns, sid)
        self.turns[rid] = (eng.session_history(sid) if sid else None, len(prompt))
        if sid:
            self.session_ns[sid], self.session_policy[sid] = ns, policy
        self.counts["session turns" if sid else "requests"] += 1

    def op(self) -> None:
        rng, eng, r = self.rng, self.eng, self.rng.random()
        if r < 0.35 and len(self.live) < 6:
            self.add()
        elif r < 0.42 and self.live:
            turns = sorted(rid for rid, (_, sid) in self.live.items() if sid)  # half the aborts hit a turn
            victims = turns if turns and rng.random() < 0.5 else sorted(self.live)
            eng.abort_request(rng.choice(victims), rng.choice(["abort", "abort", "stop"]))
            self.counts["aborts"] += 1
        elif r < 0.44:
            eng.demote_all(to_spill=rng.random() < 0.5)
        elif r < 0.46:
            for sid in SESSIONS:
                if rng.random() < 0.5:
                    eng.demote_session(sid, to_spill=rng.random() < 0.5)
        elif r < 0.47:
            eng.close_session(rng.choice(SESSIONS))
        elif r < 0.48:
            eng.flush(spill=rng.random() < 0.3)
            self.counts["flushes"] += 1
        elif r < 0.49:
            eng.drop_namespace(rng.choice(NAMESPACES))

    def step(self) -> None:
        eng, rng = self.eng, self.rng
        self.oracle.note_running()
        outs = eng.step()
        self.oracle.note_running()
        eng.wait_for_transfers()
        for out in outs:
            if not out.finished:
                continue
            ns, sid = self.live.pop(out.request_id, ("", None))
            if sid is None:
                continue
            if out.finish_reason != "abort":
                history, prompt_len = self.turns[out.request_id]
                output, x = tuple(out.output_token_ids), rng.random()
                if x < 0.25:
                    self.counts["rewinds"] += eng.rewind_session(sid, history, prompt_len, output)
                elif x < 0.6 and output:
                    keep, tail = rng.randrange(0, len(output) + 1), self.words(0, 3)
                    lead: tuple[int, ...] = ()
                    whole = eng.session_history(sid) or []
                    if rng.random() < 0.3 and len(whole) >= prompt_len >= (k := rng.randrange(1, 4)):
                        lead, keep = tuple(whole[prompt_len - k:prompt_len]), -rng.randrange(1, k + 1)
                    self.counts["cuts"] += eng.cut_session_turn(sid, out.request_id, prompt_len, output, keep,
                                                                tail, lead)
            if history := eng.session_history(sid):
                self.oracle.note(ns, history)


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_every_kept_block_holds_the_kv_of_its_tokens(tiny: LoadedModel, tmp_path: Path, seed: int) -> None:
    eng, store = make_node(tiny, tmp_path)
    oracle = Oracle(eng, store)
    fuzz = Fuzz(eng, oracle, seed)
    for it in range(STEPS):
        fuzz.op()
        fuzz.step()
        eng.check_integrity()
        bad = oracle.problems() if it % CHECK_EVERY == CHECK_EVERY - 1 else oracle.plain_problems()
        assert not bad, f"seed {seed} step {it}:\n" + "\n".join(bad[:10])
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        fuzz.step()
        eng.check_integrity()
    assert not eng.has_unfinished_requests()
    assert not (bad := oracle.problems()), f"seed {seed} end:\n" + "\n".join(bad[:10])
    stats = eng.stats()
    print(f"seed {seed}:", dict(fuzz.counts), dict(oracle.checked),
          {k: stats[k] for k in ("demoted_blocks", "promoted_host_blocks", "installed_spill_blocks")},
          "preemptions", eng.scheduler.num_preemptions)
    # the run exercised what it claims to check (else the oracle compared nothing)
    assert min(oracle.checked[k] for k in ("device", "host", "spill", "request", "session")) > 0, oracle.checked
    assert stats["demoted_blocks"] > 0 and stats["promoted_host_blocks"] > 0
    assert fuzz.counts["session turns"] > 0 and fuzz.counts["rewinds"] + fuzz.counts["cuts"] > 0


def test_the_oracle_catches_one_wrong_slot_on_every_tier(tiny: LoadedModel, tmp_path: Path) -> None:
    """The checker is not vacuous: +1.0 in one slot of a cached block is reported on the device,
    on the host tier after ``demote_all`` and in spill after ``demote_all(to_spill=True)``; and
    +1.0 in an idle full-cache session's unhashed partial block is reported for that session."""
    eng, store = make_node(tiny, tmp_path)
    oracle = Oracle(eng, store)
    prompt = [(7 * i) % 500 + 1 for i in range(10)]
    oracle.note("A", prompt)
    eng.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), request_id="t1", cache_namespace="A",
                    session_id="s", tenant="t")
    drain(eng)
    history = eng.session_history("s")
    assert history is not None and len(history) == 15
    oracle.note("A", history)
    assert oracle.problems() == []

    sess = eng.sessions.sessions["s"]
    partial = sess.blocks[-1]  # tokens 12..13 computed (the last output has no KV yet)
    assert sess.num_computed_tokens == 14 and partial.block_hash is None
    eng.pool.blocks_view()[1, 1, partial.block_id, 1] += 1.0  # layer 1, V, slot 1
    bad = oracle.problems()
    assert len(bad) == 1 and bad[0].startswith("session s (full) block 3"), bad
    eng.pool.blocks_view()[1, 1, partial.block_id, 1] -= 1.0
    assert oracle.problems() == []

    eng.close_session("s")  # its hashed blocks stay cached, free
    cached = eng.kv_manager.pool.cached
    victim = cached[hash_prompt_blocks(prompt, BS, ("A", eng.model_id, eng.kv_format))[1]]  # tokens 4..7
    eng.pool.blocks_view()[0, 0, victim.block_id, 2] += 1.0  # layer 0, K, slot 2
    bad = oracle.problems()
    assert len(bad) == 1 and bad[0].startswith(f"device block {victim.block_id}"), bad

    assert eng.demote_all() > 0
    bad = oracle.problems()
    assert len(bad) == 1 and bad[0].startswith("host slot"), bad

    eng.demote_all(to_spill=True)
    bad = oracle.problems()
    assert len(bad) == 1 and bad[0].startswith("spill block"), bad
