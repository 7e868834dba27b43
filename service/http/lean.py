"""The hot path without the framework's layers: POST /classify and /classify/batch called
straight from the outer middleware (RequestContext).

A request through FastAPI crosses the exception middleware, the exit-stack middleware, the
router's match over every route and the route's request/response wrappers before the route's
own code runs; for a 28x28 /classify that was a quarter of the front's event-loop time
(docs/PERFORMANCE.md, issue 55). A route whose endpoint takes only the Request and returns a
Response needs none of it: `Lean` runs the route's own guard (key, unknown query parameters,
X-Min-Gallery-Version: GuardedRoute.guard), the endpoint, and on an exception the app's own
exception handler for it, so answers, problems, metrics labels and headers are the same as
through the router. Which routes: `lean_routes` (those whose endpoint takes only `request`).
"""

from __future__ import annotations

import inspect

from starlette.requests import Request

from service.http.deps import GuardedRoute


def lean_routes(routers) -> dict[tuple[str, str], GuardedRoute]:
    """{(method, path): route} of the routes of `routers` (APIRouters the app includes without
    a prefix) that can be called directly: fixed path, an endpoint of one parameter, the
    Request."""
    out = {}
    for route in (r for router in routers for r in router.routes):
        if not isinstance(route, GuardedRoute) or route.param_convertors:
            continue
        params = list(inspect.signature(route.endpoint).parameters.values())
        if len(params) == 1 and params[0].annotation in (Request, "Request"):
            for method in route.methods or ():
                out[(method, route.path)] = route
    return out


class Lean:
    """Calls the lean routes of `routers`; `None` from `find` sends a request the usual way.
    (The routers' own route objects: FastAPI's router keeps included routers in private
    wrappers.)"""

    def __init__(self, routers):
        self._routes = lean_routes(routers)

    def find(self, scope) -> GuardedRoute | None:
        return self._routes.get((scope.get("method"), scope.get("path")))

    async def __call__(self, route: GuardedRoute, scope, receive, send) -> None:
        scope["route"], scope["endpoint"] = route, route.endpoint  # (the metrics label)
        scope.setdefault("path_params", {})
        request = Request(scope, receive, send)
        try:
            await route.guard(request)
            response = await route.endpoint(request)
        except Exception as e:
            handler = _handler(scope["app"], e)
            if handler is None:
                raise  # RequestContext: logged, a 500 problem
            response = await handler(request, e)
        await response(scope, receive, send)


def _handler(app, e: Exception):
    """The app's exception handler for `e` (the nearest class in its MRO), as Starlette's
    ExceptionMiddleware looks it up."""
    for cls in type(e).__mro__:
        if cls in app.exception_handlers:
            return app.exception_handlers[cls]
    return None
