"""``twostroke serve``: an OpenAI-compatible HTTP server over any engine surface.

:func:`serve` runs it inside the caller's task group (uvicorn on asyncio, Hypercorn on trio);
:func:`build_app` gives the bare ASGI application; both take their limits as one
:class:`~twostroke.engine.config.ServerConfig` (re-exported here). See docs/serving.md.
"""

from twostroke.engine.config import ServerConfig
from twostroke.engine.server.app import build_app
from twostroke.engine.server.errors import ApiError
from twostroke.engine.server.metrics import ServerMetrics
from twostroke.engine.server.serve import serve

__all__ = ["ApiError", "ServerConfig", "ServerMetrics", "build_app", "serve"]
