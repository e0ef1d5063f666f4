"""draftkit: train EAGLE3 speculative-decoding draft heads with PyTorch Lightning."""

__version__ = "0.1.0"
