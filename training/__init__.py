"""Training stage: datasets, memory bank, NCA loss, softmax baseline, train loop, DDP."""
