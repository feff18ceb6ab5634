"""One module per family: its spec dataclass, its table of named specs (``SPECS``) and ``components(spec)``,
the pipeline's components built with the shared factories (:mod:`common.builtin.text_encoders`,
:mod:`common.builtin.image_encoders`, :mod:`common.builtin.vaes`, :mod:`common.builtin.tokenizer`)."""
