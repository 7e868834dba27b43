"""Index builder: training run dir -> FAISS index dir (contract: embedding/index.py)."""
