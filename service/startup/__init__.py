"""Start-up: from settings to a serving ServiceState, in two steps, in parts by concern.

`open` (opening.py; before the port is bound, so that a bad model, index or store is an exit
status 2 with a message): load the model and its index dir, start the model thread, find the
data dir and decide whether its gallery store must first be carried to this model
(service/store/migration.py); which gallery that is: which_gallery.py.

`finish` (finishing.py): carry the gallery if needed (carry.py; in the background when started
by snca-serve, with /readyz saying "migrating N of M" meanwhile), open the store, load the index
snapshot or the built index, replay the writes after it, load the gallery, warm the vote up.

`ServiceHost` (host.py) is what the app holds from the first request on: settings, metrics,
where start-up is, and the ServiceState once it is built.
"""

from service.startup.finishing import finish_service, load_gallery
from service.startup.host import ServiceHost
from service.startup.opening import MODEL_PLACES, Opening, load_world, open_service, photo_model
from service.startup.which_gallery import follow_alias, register_model, settle_galleries

__all__ = [
    "MODEL_PLACES",
    "Opening",
    "ServiceHost",
    "finish_service",
    "follow_alias",
    "load_gallery",
    "load_world",
    "open_service",
    "photo_model",
    "register_model",
    "settle_galleries",
]
