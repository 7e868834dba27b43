"""FastAPI service: classify, register labels, search; durable gallery writes."""
