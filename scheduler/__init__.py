"""radixmux.scheduler"""
