"""metrale's C kernels (``*.c``, and the headers ``packed.h`` and
``vector_math.h``) and ``binding``, which compiles them once and binds their
entry points for the runtime."""
