"""The in-memory gallery, split along its seams: the FAISS index with tombstones
(vectors.py), the dense rows and per-label statistics (rows.py), the vote rules
(embedding.votes) and the compiled kde path (compiled.py), the open-set calibration
(openset.py) and a label's diagnostics (diagnostics.py), put together in gallery.py.

Nothing is imported here: the labels' rules (labels.py) cost no torch import."""
