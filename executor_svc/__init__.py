"""The executor: holds the weights and the KV-cache pool, runs the model on
the scheduler's step plans and samples."""
