"""radixmux.runtime"""
