"""Test-wide setup.

TRITON_INTERPRET=1 must be set before any Triton kernel module is imported: with it, the Triton
kernels run on CPU tensors through Triton's interpreter, so CI (no GPU) compares them bit-exactly with
the torch reference.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
