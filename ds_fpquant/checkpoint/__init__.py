"""Layer 7, checkpoint: Hugging Face model directories, the on-disk layouts (``docs/checkpoints.md``), checkpoint keys,
the writer (``ds-fpquant quantize``, ``save_quantized``, ``save_pretrained``) and the reader (``load_quantized``)."""
