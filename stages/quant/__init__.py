"""The quantization math (GPTQ and its Hessians, weight grids, measured sensitivity, calibration text,
quality metrics) and the onnxruntime host runner it measures with. Imports the core, the model and
planning."""
