"""`quantfw bench`: end-to-end measurement of quantization methods on dummy weights."""
