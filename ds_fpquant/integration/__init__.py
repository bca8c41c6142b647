"""Layer 8, integration: DeepSpeed (``apply``, ``init_inference`` with AutoTP, ``patch_deepspeed``, the
``FP_Quantize`` and ``matmul_fp8`` drop-ins)."""
