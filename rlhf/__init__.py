"""rlhf-pipeline shared library: algorithms, wire contract, transport, serving. Imports no service."""

__version__ = "0.1.0"
