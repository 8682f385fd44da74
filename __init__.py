"""radixmux: several LLMs served side by side over one unified radix cache."""

__version__ = "0.1.0"
