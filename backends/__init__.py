"""The torch.compile backend (compiler.py) and its lowering; Triton kernels in triton/."""
