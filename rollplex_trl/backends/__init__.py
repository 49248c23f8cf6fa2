"""Training backends other than the HF model itself (``rollplex_backend``)."""
