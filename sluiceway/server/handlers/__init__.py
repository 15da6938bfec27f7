"""One module per API surface; each handler is ``(scope, receive, send)``."""
