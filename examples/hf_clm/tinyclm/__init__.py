"""A tiny causal language model project: a generated corpus, a word-level tokenizer built from it,
fixed-length token blocks, and the defects the tests plant (``tinyclm.plants``)."""
