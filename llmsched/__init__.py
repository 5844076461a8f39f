"""Thin shared package: generated gRPC stubs (`llmsched.v1`) and the server
helpers both services use. Nothing here imports torch."""
