"""OpenAI-compatible HTTP server over an `AsyncEngine` (FastAPI; ``pip install quantfw[serve]``).

`protocol` holds the request/response models both routes share, `serving` what their serving
classes share, `serving_completions` and `serving_chat` one route each, `metrics` the
Prometheus exporter and `api_server` the app (``build_app``).
"""
