"""The HTTP edge: the ASGI app, routing, the exchange, auth, /health and the CLI."""

from sluiceway.server.app import SluicewayApp, create_app
from sluiceway.server.config import ServerConfig

__all__ = ["ServerConfig", "SluicewayApp", "create_app"]
