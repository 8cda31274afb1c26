"""Benchmarks: ``cachexferd bench swap`` (and ``bench storage``)."""
