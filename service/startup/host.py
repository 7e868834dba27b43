"""`ServiceHost`: what the app holds from the first request on: settings, metrics, where
start-up is (/readyz's status), and the ServiceState once it is built."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from service.config import Settings
from service.metrics import Metrics
from service.startup.finishing import finish_service
from service.startup.opening import MODEL_PLACES, Opening, open_service, photo_model
from service.startup.which_gallery import register_model
from service.state import ServiceState

log = logging.getLogger("snca.service")


class ServiceHost:
    """What the app holds: settings and metrics from the start, the ServiceState once built,
    and meanwhile the start-up phase (/readyz reports it)."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None, model: str = "thread"):
        """`model`: where the model runs, one of MODEL_PLACES (snca-serve: "process" unless
        SNCA_MODEL_PROCESS=0; tools and tests that embed in-process: "thread")."""
        if model not in MODEL_PLACES:
            raise ValueError(f"model {model!r}: one of {', '.join(MODEL_PLACES)}")
        self.settings = settings
        if "thumbnails" not in settings.model_fields_set:  # not said: on for a photo model
            settings.thumbnails = photo_model(settings)
        self.model_place = model
        self.metrics = metrics or Metrics()
        # the model process relays its start-up to the front (service/model_process.py)
        self.on_progress: Callable[[int, int], None] | None = None
        self.on_waiting: Callable[[str], None] | None = None
        self.opening: Opening | None = None
        self.state: ServiceState | None = None
        self.phase = "starting"  # starting | migrating | ready | failed | stopping
        self.progress = (0, 0)  # migration: (items done, items to carry)
        self.waiting: str | None = None  # migration: what it waits for (other processes)
        self.error: str | None = None
        self.on_failure: Callable[[], None] | None = None  # snca-serve: stop the server
        # called with the ServiceState once built, before the host says ready (the app hooks
        # its parked-request waits to the gallery's versions there: service/http/admission.py)
        self.on_ready: list[Callable[[ServiceState], None]] = []
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.state is not None

    def open(self) -> Opening:
        if self.opening is None:
            self.opening = open_service(self.settings, self.metrics, self.model_place)
        return self.opening

    def finish(self) -> ServiceState:
        o = self.open()
        if o.plan is not None:
            self.phase = "migrating"
            self.progress = (0, o.plan.total)
        elif o.beside is not None or o.carried_elsewhere is not None:
            self.phase = "migrating"  # in the model process: it reports the progress
        message = "model process ready" if self.model_place == "inline" else "ready"
        try:
            if self.model_place == "process" and o.carried_elsewhere is None:
                # nothing to carry first: the front loads its replica while the model process
                # loads its own and warms up (start-up ~ the longer of the two, not their sum)
                model_ready = self._model_ready_in_background(o)
            else:
                o.runtime.wait_ready(self._report, self._waiting)
                model_ready = None
            self.state = finish_service(
                o, self.settings, self.metrics, self._report, self._waiting, message, model_ready
            )
        except BaseException:
            o.runtime.close()
            raise
        if self.model_place != "inline":  # (once per worker: the front does it)
            try:
                register_model(self.settings)
            except Exception as e:  # (bookkeeping for rollbacks: never fails a start)
                log.warning("could not record this model in the galleries' registry: %s", e)
        for hook in self.on_ready:
            hook(self.state)
        self.phase = "ready"
        return self.state

    def _model_ready_in_background(self, o: Opening) -> Callable[[], None]:
        """Wait for the model process on a thread; the returned call joins it (re-raising)."""
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                o.runtime.wait_ready(self._report, self._waiting)
            except BaseException as e:  # (handed to the joining thread)
                failed.append(e)

        t = threading.Thread(target=wait, name="model-process-start", daemon=True)
        t.start()

        def join() -> None:
            t.join()
            if failed:
                raise failed[0]

        return join

    def finish_in_background(self) -> None:
        """`finish` on a thread (a migration can take minutes); a failure is logged, kept for
        /readyz and handed to `on_failure`."""

        def run() -> None:
            try:
                self.finish()
            except Exception as e:
                self.error = str(e)
                self.phase = "failed"
                log.exception("start-up failed")
                if self.on_failure is not None:
                    self.on_failure()

        self._thread = threading.Thread(target=run, name="start-up", daemon=True)
        self._thread.start()

    def _report(self, done: int, total: int) -> None:
        self.progress = (done, total)
        if self.on_progress is not None:
            self.on_progress(done, total)

    def _waiting(self, why: str) -> None:
        self.waiting = why
        if self.on_waiting is not None:
            self.on_waiting(why)

    def status(self) -> str:
        """One line for /readyz and the 503s of the other routes while not ready."""
        if self.phase == "migrating":
            done, total = self.progress
            line = f"migrating the gallery to the new model: {done} of {total} added items"
            return line + (f"; {self.waiting}" if self.waiting else "")
        if self.phase == "failed":
            return f"start-up failed: {self.error}"
        return "the service is not ready yet" if self.phase != "stopping" else "shutting down"

    def stop(self) -> None:
        self.phase = "stopping"
        if self.state is not None:
            self.state.stop()
        elif self.opening is not None and (self._thread is None or not self._thread.is_alive()):
            self.opening.runtime.close()
