"""The step half of the executor: what runs step plans. The step loop
(step_loop.py) decides on which thread each plan runs, in order. The runner
(runner.py) applies the plan to persistent request rows (request_rows.py),
runs the model over the KV pool (kv_cache.py, with the host tier in
host_kv.py and host_memory.py), and samples (sampler.py) under the
constraints' token masks (constraints.py); CUDA graphs (cuda_graphs.py) and
compiled CPU decode (compiled_decode.py) replay the decode forward."""
