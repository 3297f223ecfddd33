"""Without a CUDA device, Triton kernels run in Triton's interpreter on CPU tensors.

Imported by ``tests/conftest.py`` before anything else imports triton (the engine's imports
reach it through torch): ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel, or
triton.language's own helpers, are decorated, so setting it later has no effect. With CUDA the
kernels compile for the device as in serving.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
