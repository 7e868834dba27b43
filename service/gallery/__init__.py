"""The in-memory gallery, split along its seams: the FAISS index with tombstones
(vectors.py), the dense rows and per-label statistics (rows.py), the vote rules
(embedding.votes) and the compiled kde path (compiled.py), the open-set calibration
(openset.py) and a label's diagnostics (diagnostics.py), put together in gallery.py."""

from service.gallery.diagnostics import Diagnostics
from service.gallery.gallery import Classification, Gallery
from service.gallery.lock import RWLock
from service.gallery.vectors import VectorIndex

__all__ = ["Classification", "Diagnostics", "Gallery", "RWLock", "VectorIndex"]
