"""The gallery's FAISS index with deletions.

Only indexes that renumber on removal (Flat and the other flat-code indexes: PQ, SQ) remove
ids. IndexIDMap2's remove_ids assumes that renumbering: under an IVF index it compacts its id
map while the inverted lists keep the old positions, so every later search returned other
items' ids (found by the candidate vote's tests; regression test in test_candidate_vote.py).
HNSW and GPU indexes cannot remove at all (FAISS issues #3339, #1585). Deleted ids of all
those are kept as tombstones and filtered at search time with an IDSelector (the next snapshot
or rebuild still holds them; a snapshot records them).
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

from embedding.index import tune_faiss

tune_faiss()


class VectorIndex:
    def __init__(self, index, search_params: dict[str, Any], tombstones: set[int] | None = None):
        self.index = index  # faiss IndexIDMap2, CPU
        self.search_params = dict(search_params)  # the manifest's nprobe / efSearch
        self.tombstones: set[int] = set(tombstones or ())  # deleted ids still in the index

    def add(self, ids: np.ndarray, emb: np.ndarray) -> None:
        """ids (n,) int64, emb (n, d) float32 unit rows."""
        self.index.add_with_ids(
            np.ascontiguousarray(emb, dtype=np.float32), np.asarray(ids, dtype=np.int64)
        )

    def vector(self, item_id: int) -> np.ndarray:
        """(d,) the stored vector of an item; RuntimeError when the index does not hold it (an
        IVF index gets its direct map once: it reconstructs by list and offset only with it)."""
        ivf = faiss.try_extract_index_ivf(faiss.downcast_index(self.index.index))
        if ivf is not None and ivf.direct_map.no():
            ivf.make_direct_map()
        return self.index.reconstruct(int(item_id))

    def held(self) -> set[int]:
        """The ids the index holds and has not tombstoned (read once at start-up)."""
        return set(faiss.vector_to_array(self.index.id_map).tolist()) - self.tombstones

    def ids(self) -> np.ndarray:
        """(n,) int64 the id of every vector not tombstoned, in the index's order (an id held
        twice is there twice)."""
        out = faiss.vector_to_array(self.index.id_map).astype(np.int64)
        if self.tombstones:
            out = out[~np.isin(out, np.fromiter(self.tombstones, np.int64))]
        return out

    def live_count(self) -> int:
        """Vectors not tombstoned (equal to the gallery's live items while the two agree)."""
        return int(self.index.ntotal) - len(self.tombstones)

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which of `ids` the index holds (tombstoned or not); one lookup each."""
        out = np.zeros(len(ids), dtype=bool)
        for k, i in enumerate(np.asarray(ids, dtype=np.int64).tolist()):
            try:
                self.vector(i)
                out[k] = True
            except RuntimeError:
                pass
        return out

    def removable(self) -> bool:
        """Whether remove() takes vectors out (flat codes) rather than tombstoning them."""
        inner = faiss.downcast_index(getattr(self.index, "index", self.index))
        return isinstance(inner, faiss.IndexFlatCodes)

    def remove(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        if self.removable():
            try:
                self.index.remove_ids(ids)
                return
            except RuntimeError:
                pass
        # IVF (no renumbering), HNSW and GPU indexes: filter at search time
        self.tombstones.update(int(i) for i in ids)

    def search(
        self, q: np.ndarray, k: int, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """q (B, d) -> similarities (B, k) descending and ids (B, k), -1 where fewer than k
        items qualify; `allowed`: only these ids (a label filter)."""
        return self.index.search(
            np.ascontiguousarray(q, dtype=np.float32), k, params=self._params(allowed)
        )

    def serialize(self) -> tuple[np.ndarray, set[int]]:
        """(faiss.serialize_index bytes, tombstones): what a snapshot stores."""
        return faiss.serialize_index(self.index), set(self.tombstones)

    def _params(self, allowed: np.ndarray | None):
        """FAISS search parameters: the manifest's nprobe/efSearch, plus an id selector that
        drops tombstones and keeps only `allowed` ids when a label filter is given."""
        sel = None
        if allowed is not None:
            sel = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
        if self.tombstones:
            gone = faiss.IDSelectorNot(
                faiss.IDSelectorBatch(np.fromiter(self.tombstones, np.int64))
            )
            sel = gone if sel is None else faiss.IDSelectorAnd(sel, gone)
            sel._keep = gone  # keep the inner selectors alive as long as the outer one
        if sel is None:
            return None
        if "nprobe" in self.search_params:
            p = faiss.SearchParametersIVF(sel=sel, nprobe=int(self.search_params["nprobe"]))
        elif "efSearch" in self.search_params:
            p = faiss.SearchParametersHNSW(sel=sel, efSearch=int(self.search_params["efSearch"]))
        else:
            p = faiss.SearchParameters(sel=sel)
        p._sel = sel
        return p
