"""Commands beside the pipeline: the benchmarks, `make doctor`, the generated docs and the config walk
(issue 34's measure of how the config travels through a stage). They may import
any layer and any stage; nothing but the CLI imports them."""
