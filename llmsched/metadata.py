"""The gRPC trailing-metadata keys the scheduler sets and its front ends
(the gateway) read: one definition for both sides of the wire."""

# How long a shed request should wait before it comes back.
RETRY_AFTER_MS = "retry-after-ms"
# The tenant a call was served or refused as.
TENANT = "llmsched-tenant"
# A refusal's GenerateRequest field, and the grammar line llguidance blamed.
FIELD = "llmsched-field"
GRAMMAR_LINE = "llmsched-grammar-line"
