"""What the app bounds per process, beside the service: requests parked until a gallery
version (X-Min-Gallery-Version, service/http/waits.py), and the label-diagnostics calls (a
gate and a cache of recent answers). Made by create_app, hooked to the gallery once the
service is ready (ServiceHost.on_ready)."""

from __future__ import annotations

from service.config import Settings
from service.http.cache import Recent
from service.http.gate import Gate
from service.http.waits import VersionWaits
from service.metrics import Metrics
from service.state import ServiceState


class Admission:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.waits = VersionWaits(
            settings.max_parked, settings.max_parked_per_client, metrics.parked
        )
        # GET /gallery/diagnostics: 0.25-0.4 s of CPU each (a label's sample of <= 200 items),
        # so a bounded number at once, and the same answer again until the gallery changes
        self.diagnostics_gate = Gate(
            "label diagnostics", settings.diagnostics_concurrency, settings.diagnostics_queue
        )
        self.diagnostics_cache = Recent(64)

    def attach(self, state: ServiceState) -> None:
        """Parked requests wake when the thread applying a write reaches their version."""
        state.gallery.on_version = self.waits.notify
        state.eager = lambda: self.waits.parked > 0  # (the follower polls at its full rate)
