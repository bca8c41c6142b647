"""compressed-tensors' layout (``quant_method: "compressed-tensors"``). ``read.py``: its schemes read (0.20.1);
``write.py``: written for its readers (compressed-tensors, transformers, vLLM)."""
