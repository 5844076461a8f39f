"""The scheduler's core: a synchronous library with no I/O. Requests and
their states, the block pool and block tables of both tiers, the
scheduling rule and its policies, admission, the step plan and result as
plain dataclasses, and EngineCore, which decides what to send when and
what a result does. The service around it (scheduler_svc/) adds gRPC,
asyncio, tokenizing and streams; the simulator drives it in virtual time.

Nothing here imports grpc, protobuf, asyncio or torch
(tests/unit/test_scheduler_core.py)."""
