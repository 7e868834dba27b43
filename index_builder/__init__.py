"""Index builder: run dir -> FAISS index dir (not implemented yet; see the index issue)."""
