"""The memory model: predicted peak GPU memory per component, for one device and sharded over several."""
