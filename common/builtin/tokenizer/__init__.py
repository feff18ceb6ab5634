"""The tokenizers of the built-in models, trained here on one corpus (:mod:`.corpus`)."""
