"""API surfaces: one folder per API (``openai/``), each mapping its requests
onto the neutral generation request and spelling the neutral events as its
replies, over shared pieces: the seam the HTTP edge calls (``base``), the
conversation renderer (``conversation``), neutral checks (``validation``) and
SSE framing (``sse``). See docs/architecture.md, "How to add a surface"."""
