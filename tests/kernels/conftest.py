"""Kernel tests run Triton through its interpreter when there is no GPU.

The interpreter must be chosen before Triton is first imported, hence here.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
