"""Speculation inside the step: one module per draft source (``copies``: prompt
lookup, ``mtp``: the MTP drafter, ``constrained``: a grammar's forced tokens,
and the check and masks every draft of a constrained request goes through)
and the acceptance rules every draft is verified by (``acceptance``);
``grammar`` compiles and binds grammars, ``matcher`` holds one request's.
The engine loop calls these; they call the runtime only through the
``Model``/``MtpModule`` protocols."""
