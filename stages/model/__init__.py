"""The model and the graphs it is cut into: its geometry, checkpoints (built-in, downloaded,
compressed-tensors), chat template and reference runs, and the graphs' kinds, names, I/O contract and
encodings, with the torch decoder that writes them. Imports only the core."""
