"""What an executor's start costs beyond reading its weights: building the
model on the meta device must not pull in torch._dynamo (1.8 s of every
start on two cores when nn.Embedding's random initialisation did)."""

from __future__ import annotations

import os
import subprocess
import sys

LOAD_AND_REPORT = """
import sys
from executor_svc.config import ExecutorSettings
from executor_svc.loading import load
from llmsched.errors import load_settings
load(load_settings(ExecutorSettings))
print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_loading_the_builtin_model_eagerly_does_not_import_torch_dynamo():
    env = {**os.environ, "EXECUTOR_TORCH_COMPILE": "off", "EXECUTOR_NUM_KV_BLOCKS": "64"}
    env.pop("EXECUTOR_MODEL", None)
    out = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "torch._dynamo imported: False" in out, out
