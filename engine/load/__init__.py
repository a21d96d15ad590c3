"""Turning a model source into a runtime: the checkpoint reader, the embedded
default model, MTP heads resolved for a model, and ``$METRALE_HOME``.

Kept free of imports so that ``metrale.engine.load.home`` can be reached from
below the runtime without loading the loader."""
