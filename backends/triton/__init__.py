"""Triton kernels for the codecs' hot paths, one module per codec family.

Each module follows the Triton tutorials' layout: private ``_*_kernel`` functions, then host
launchers with the same signature as the torch reference in ``ccfx.codecs.<family>``. CUDA
tensors take these kernels; CPU tensors take the reference (the interpreter,
``TRITON_INTERPRET=1``, runs them on CPU for the tests). Importing this package needs triton, so
codecs import the launchers lazily, only when a CUDA tensor arrives.
"""
