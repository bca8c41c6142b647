"""ds_fpquant's own layouts: block FP8 (``quant_method: "fp8"``; AutoFP8 per-tensor FP8 read too) and ``"ds_fpquant"``
(packed codes). ``read.py``: the layouts and their reading; ``write.py``: writing them."""
