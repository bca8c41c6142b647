"""NVIDIA ModelOpt's layout (``quant_method: "modelopt"``, ``hf_quant_config.json``). ``read.py``: its exports read
(0.47); ``write.py``: written as its export writes them."""
