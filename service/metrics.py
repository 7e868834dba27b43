"""Prometheus metrics (one registry per app, so tests can build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "snca_requests_total", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "snca_request_seconds",
            "request latency",
            ["route"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.batch_size = Histogram(
            "snca_batch_size",
            "images per forward pass",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.queue_wait = Histogram(
            "snca_queue_wait_seconds",
            "time the oldest job of a batch waited",
            registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
        )
        self.model_seconds = Counter(
            "snca_model_seconds",
            "seconds the model spent on its batches, by phase: decode (uploads the model "
            "process decoded), forward, vote (the votes and world checks), other (the model "
            "process's catching up with the log, answers and framing)",
            ["phase"],
            registry=r,
        )
        self.gallery_items = Gauge(
            "snca_gallery_items", "live gallery items", ["source"], registry=r
        )
        self.classified = Counter(
            "snca_classified_total", "classified images", ["vote"], registry=r
        )
        self.parked = Gauge(
            "snca_parked_requests",
            "requests waiting for an X-Min-Gallery-Version to be applied",
            registry=r,
        )
        self.unknown = Counter(
            "snca_unknown_total", "classified images flagged unknown", registry=r
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
