"""gpt-oss's MXFP4 experts layout (``quant_method: "mxfp4"``). ``read.py``: the layout and its reading;
``write.py``: writing it."""
