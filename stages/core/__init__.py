"""The core every other layer shares, with no knowledge of any model: the errors, the pipeline config
and its presets, the SoC and precision tables, the stage and runtime tables, reports and stamps, and
what stage commands share. Imports nothing else from stages/."""
