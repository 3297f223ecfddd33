"""Okapi BM25 lexical index over a fixed list of documents (numpy scoring).

Source: Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and
Beyond" (2009), eq. 3.26, with the non-negative idf ``log(1 + (N - n + 0.5) / (n + 0.5))``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from workloads.text import tokenize


class BM25Index:
    """An inverted index: term -> (document indices, term frequencies).

    Args:
        documents: the texts to index, in order; a hit is reported by its index.
        k1: term-frequency saturation (> 0).
        b: length normalisation in [0, 1].

    Raises:
        ValueError: no documents, or ``k1``/``b`` out of range.
    """

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        if not documents:
            raise ValueError("BM25Index needs at least one document")
        if k1 <= 0 or not 0.0 <= b <= 1.0:
            raise ValueError(f"need k1 > 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        postings: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        lengths = np.zeros(len(documents), dtype=np.float64)
        for doc_index, text in enumerate(documents):
            counts = Counter(tokenize(text))
            lengths[doc_index] = sum(counts.values())
            for term, tf in counts.items():
                postings[term][0].append(doc_index)
                postings[term][1].append(tf)
        self.num_documents = len(documents)
        self._norm = k1 * (1.0 - b + b * lengths / max(lengths.mean(), 1e-9))
        self._k1 = k1
        self._postings = {
            term: (np.asarray(docs, dtype=np.int64), np.asarray(tfs, dtype=np.float64))
            for term, (docs, tfs) in postings.items()
        }

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query``: shape ``(num_documents,)``."""
        scores = np.zeros(self.num_documents, dtype=np.float64)
        for term in set(tokenize(query)):
            if term not in self._postings:
                continue
            docs, tfs = self._postings[term]
            idf = np.log1p((self.num_documents - len(docs) + 0.5) / (len(docs) + 0.5))
            scores[docs] += idf * tfs * (self._k1 + 1.0) / (tfs + self._norm[docs])
        return scores

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best ``(doc_index, score)`` with score > 0, best first.

        Ties keep index order, so results are deterministic.

        Raises:
            ValueError: ``k`` is not positive.
        """
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        scores = self.scores(query)
        order = np.argsort(-scores, kind="stable")[:k]
        return [(int(i), float(scores[i])) for i in order if scores[i] > 0.0]
