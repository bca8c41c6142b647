"""Layer 9, cli: the ``ds-fpquant`` command (``demo``, ``bench``, ``report``, ``quantize``)."""
