"""The model half of the executor: the shared decoder (model.py), its
layers (layers.py, moe.py, mla.py), one module per family written as its
difference from Llama (families/), the config each family reads
(model_config.py), checkpoint reading (checkpoint.py, mxfp4.py), the
built-in models (builtin.py) and the tensor-parallel split (sharding.py)."""
