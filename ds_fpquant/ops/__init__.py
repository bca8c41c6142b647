"""Layer 2, ops: the backends (the compiled CUDA and CPU ops built by ``op_builder``, and the torch reference with
the same interface) and which one a call gets."""
