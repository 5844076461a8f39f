"""Generated gRPC stubs for the llmsched.v1 protos (python -m devtools.genproto)."""
