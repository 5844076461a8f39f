"""OpenAI-compatible HTTP front end: a thin, torch-free client of the
scheduler's public gRPC API."""
