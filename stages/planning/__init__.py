"""What one config builds from one geometry (the Job), what it costs and whether it fits (fitting, the
disk and memory needs, `make plan`'s text), and the typed records through which later stages read a
stage's output back (results). Imports the core, the model and the runtime registry."""
