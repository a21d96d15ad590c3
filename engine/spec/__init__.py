"""Speculation inside the step: one module per draft source (``copies``: prompt
lookup, ``mtp``: the MTP drafter) and the acceptance rules every draft is
verified by (``acceptance``). The engine loop calls these; they call the
runtime only through the ``Model``/``MtpModule`` protocols."""
