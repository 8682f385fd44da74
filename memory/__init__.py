"""radixmux.memory"""
