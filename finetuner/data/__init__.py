"""The data pipeline: files and their formats → examples → tokens, masks and packing; the on-disk cache; lengths for the planner; the preview."""
