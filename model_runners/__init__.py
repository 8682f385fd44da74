"""radixmux.model_runners"""
