"""The scheduler: public gRPC API, request state, KV block tables and the
per-step batching decisions. CPU only; it must never import torch."""
