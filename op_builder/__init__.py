"""DeepSpeed ``OpBuilder`` subclasses that JIT-compile this project's ``csrc/`` (installed as
``ds_fpquant.op_builder``)."""
