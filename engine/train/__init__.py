"""``metrale train-mtp``: self-generated training data, cached hidden states and
the training loop of an MTP head. A leaf: only ``metrale.cli`` imports it."""
