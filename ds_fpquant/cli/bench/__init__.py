"""``ds-fpquant bench``: the ops' throughput (:mod:`.ops`) and the quantized linear (:mod:`.linear`, ``--linear``)."""
