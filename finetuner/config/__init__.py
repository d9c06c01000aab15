"""What a run is asked to do and where: the recipe schema, the known cards, and the runtime (recipe + device resolved once)."""
