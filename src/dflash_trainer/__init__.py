"""DFlash Trainer: train DFlash speculative-decoding drafters from a frozen target's hidden states."""

__version__ = "0.1.0"
