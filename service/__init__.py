"""FastAPI service (not implemented yet; see the service issue)."""
