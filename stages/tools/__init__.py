"""Commands beside the pipeline: the benchmarks, `make doctor` and the generated docs. They may import
any layer and any stage; nothing but the CLI imports them."""
