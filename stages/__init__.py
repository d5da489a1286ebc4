"""g4v69: Gemma 4 E2B to QNN context binaries for the Hexagon v69 NPU, packaged as a Genie bundle."""

__version__ = "0.1.0"
